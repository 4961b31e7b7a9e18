"""Self-distillation data (train/data.py): the features recorded while the
engine generates are the ones a separate target pass computes (train/eagle3.py)."""

from __future__ import annotations

import torch

from specdec.models import load_model
from specdec.sampling import SamplingParams
from tests.drafter.test_eagle import VOCAB, make_target
from train import data, eagle3
from verifier.engine import Engine, EngineConfig, Request

LAYERS = (2, 4, 5)


def test_recorded_features_match_a_target_pass(tmp_path):
    make_target(tmp_path / "target")
    model = load_model(tmp_path / "target", dtype="float32")
    layers = eagle3.feature_layers(LAYERS, model.config.num_layers)  # and the final state
    recorder = data.FeatureRecorder(layers)
    engine = Engine(model, EngineConfig(max_num_seqs=3, max_model_len=64, num_kv_blocks=16,
                                        max_num_batched_tokens=192), proposer=recorder)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in (5, 9, 7)]
    for i, p in enumerate(prompts):  # a wave: prefilled together, then decoded
        engine.add_request(Request(str(i), p, 6 + i, SamplingParams(temperature=0.0)))
    replies = {str(i): [] for i in range(3)}
    while engine.has_work():
        for o in engine.step():
            replies[o.request_id].extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        tokens = p + replies[str(i)]
        got = data.sequence_features(recorder.finished[str(i)], len(tokens))
        want = eagle3.target_features(model, torch.tensor(tokens), layers)
        assert got.shape == want.shape
        torch.testing.assert_close(got[:-2].float(), want[:-2].float(), atol=2e-3, rtol=2e-3)
    assert eagle3.feature_key(tokens, LAYERS) == eagle3.feature_key(tuple(tokens), list(LAYERS))
