"""The draft model's one-token draft steps through the CUDA-graph runner: on
CPU (the runner pads and copies, then calls the forward) and replayed on a GPU,
the proposals are those of the plain method. Kept apart from test_draft_model.py
so that a GPU machine collects it without the serving stack installed."""

from __future__ import annotations

import random

import pytest
import torch

from drafter.draft_model import DraftModelMethod
from specdec.generate import greedy_generate
from specdec.models import LlamaForCausalLM
from specdec.models.cuda_graphs import CudaGraphRunner
from specdec.sampling import SamplingParams
from tests.tiny import tiny_llama
from tests.verifier.test_cuda_graphs import corrupt_graph_outputs

VOCAB = 97
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def draft() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, seed=2, hidden_size=32, head_dim=8)


def propose_in_step(methods: list[DraftModelMethod], rounds: int = 10) -> int:
    """Drives every method through the same rounds (starts, proposals, partial
    acceptance, a rollback); asserts that they propose the same tokens and that
    those are the draft model's greedy continuation. Returns the tokens compared."""
    rng = random.Random(4)
    ctx = {key: [rng.randrange(VOCAB) for _ in range(n)] for key, n in
           (("a", 2), ("b", 17), ("c", 40), ("d", 9), ("e", 60))}
    for method in methods:
        for key, tokens in ctx.items():
            method.start(key, tokens, [], GREEDY, max_num_speculative_tokens=8)
    compared = 0
    for rnd in range(rounds):
        wanted = {key: 1 + (rnd + i) % 5 for i, key in enumerate(ctx) if (rnd * 3 + i) % 5}
        drafts = [m.propose(wanted) for m in methods]
        for key in wanted:
            proposal = drafts[0][key].token_ids
            assert all(d[key].token_ids == proposal for d in drafts[1:]), (rnd, key)
            compared += len(proposal)
        if rnd == 0:
            reference = greedy_generate(methods[0].model, [ctx[k] for k in wanted], 5)
            for key, ref in zip(wanted, reference, strict=True):
                assert drafts[0][key].token_ids == ref[:wanted[key]]
        for key in wanted:
            proposal = drafts[0][key].token_ids
            accepted = rng.randint(0, len(proposal))
            new = proposal[:accepted] + [rng.randrange(VOCAB)]
            rollback = 1 if (rnd, key) == (4, "c") else 0
            for method in methods:
                method.advance(key, len(proposal), accepted, new, rollback, None, 0)
            del ctx[key][len(ctx[key]) - rollback:]
            ctx[key] += new
    return compared


def test_draft_steps_through_the_graph_runner_propose_the_same(draft):
    """On CPU the runner pads and copies as on a GPU and calls the forward instead
    of replaying: the proposals stay those of the plain method, and greedy drafts read
    only the argmax taken in the graph (the same with the logits after it zeroed)."""
    plain = DraftModelMethod(model=draft, num_kv_blocks=200)
    padded = DraftModelMethod(model=draft, num_kv_blocks=201)
    blind = DraftModelMethod(model=draft, num_kv_blocks=201)
    assert plain.graphs is None and padded.graphs is None  # CPU: no graphs by default
    for method in (padded, blind):
        method.graphs = CudaGraphRunner(draft, method.cache, 4, 1, method.max_model_len,
                                        capture=False, min_context=16)
    corrupt_graph_outputs(blind.graphs, logits=True)
    assert propose_in_step([plain, padded, blind]) > 40
    # Steps of 5 sequences are past the largest bucket (4): those alone ran eagerly.
    assert padded.graphs.num_runs > 10
    for key in "abcde":
        padded.free(key)
    assert padded.cache.num_free_blocks == 200  # the scratch block stays the runner's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draft_steps_replay_cuda_graphs_on_a_gpu():
    cuda_draft = tiny_llama(VOCAB, seed=2, hidden_size=32, head_dim=8).to("cuda")
    eager = DraftModelMethod(model=cuda_draft, num_kv_blocks=200, cuda_graphs=False)
    graphed = DraftModelMethod(model=cuda_draft, num_kv_blocks=200, cuda_graph_max_batch=4)
    assert eager.graphs is None and graphed.graphs is not None and graphed.graphs.capture
    assert propose_in_step([eager, graphed]) > 40
    assert graphed.graphs.num_runs > 10 and graphed.graphs.graphs
