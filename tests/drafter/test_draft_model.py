"""Draft model method: proposals are the draft model's own greedy continuation
across rounds of partial acceptance and rollback, reusing the KV of accepted
drafts; sampled proposals carry q shaped as the verifier shapes p; tokenizer
and vocabulary mismatches are refused by name; behind a real verifier the
output equals plain greedy decoding and every KV block comes back."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator

import pytest
import torch

from drafter import registry
from drafter.__main__ import build_method, build_parser, main
from drafter.draft_model import DraftModelMethod
from specdec.generate import greedy_generate
from specdec.models import LlamaForCausalLM
from specdec.pb import common_pb2, drafter_pb2
from specdec.sampling import SamplingMetadata, SamplingParams, apply_sampling
from tests.tiny import tiny_llama
from tests.verifier.test_service import (
    K_MAX,
    VOCAB,
    Stack,
    _wait_for,
    generate,
    model,  # noqa: F401 - the target fixture, shared
    prompts,
    run_concurrently,
    start_msg,
)
from verifier.drafter_client import TargetInfo, check_info

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def draft() -> LlamaForCausalLM:
    """A tiny float64 model with the target's vocabulary but other weights."""
    m = tiny_llama(VOCAB, seed=2, hidden_size=32, head_dim=8)
    return m


@pytest.fixture
def fed(draft) -> Iterator[list[int]]:
    """Token counts of the draft model's forwards, in order."""
    counts: list[int] = []
    hook = draft.register_forward_pre_hook(lambda _, args: counts.append(args[0].numel()))
    yield counts
    hook.remove()


def test_registered_and_reports_its_info(draft):
    method = registry.create("draft_model", model=draft, max_num_speculative_tokens=5,
                             max_model_len=300)
    assert isinstance(method, DraftModelMethod)
    info = method.info()
    assert info.method == common_pb2.SPEC_METHOD_DRAFT_MODEL
    assert (info.vocab_size, info.tokenizer_hash) == (VOCAB, "")
    assert (info.max_num_speculative_tokens, info.max_model_len) == (5, 300)
    assert not info.returns_probs and not info.needs_hidden_states
    with pytest.raises(ValueError, match="exactly one of model_dir"):
        DraftModelMethod()


def test_proposals_are_the_draft_models_greedy_continuation(draft, fed):
    # Small blocks and chunks: catch-up crosses block and chunk boundaries.
    method = DraftModelMethod(model=draft, num_kv_blocks=200, block_size=4,
                              max_num_batched_tokens=16)
    rng = random.Random(0)
    ctx = {key: [rng.randrange(VOCAB) for _ in range(n)]
           for key, n in (("a", 3), ("b", 20), ("c", 41))}
    for key, tokens in ctx.items():
        method.start(key, tokens[:-2], tokens[-2:], GREEDY, max_num_speculative_tokens=8)
    for rnd in range(8):
        wanted = {key: 1 + (rnd + i) % 6 for i, key in enumerate(ctx) if (rnd + i) % 4 != 3}
        fed.clear()
        drafts = method.propose(wanted)
        counts = list(fed)  # before the reference below runs the same model
        assert set(drafts) == set(wanted)
        for key, k in wanted.items():
            assert drafts[key].token_ids == greedy_generate(draft, [ctx[key]], k)[0], (rnd, key)
            assert drafts[key].probs is None
        # One catch-up forward (chunked: the first round feeds all 64 prompt tokens),
        # then one forward per further draft position.
        assert len(counts) == (4 if rnd == 0 else 1) + max(wanted.values()) - 1
        if rnd == 0:
            assert max(counts[:4]) <= 16 and sum(counts[:4]) == sum(len(c) for c in ctx.values())
        for key in ctx:
            proposal = drafts[key].token_ids if key in drafts else []
            accepted = rng.randint(0, len(proposal))
            rollback = 2 if (rnd, key) in {(2, "b"), (5, "a"), (6, "c")} else 0
            # The target's token after the accepted drafts differs from the next draft.
            nxt = (proposal[accepted] + 1 + rng.randrange(VOCAB - 1)) % VOCAB \
                if accepted < len(proposal) else rng.randrange(VOCAB)
            new = proposal[:accepted] + [nxt]
            method.advance(key, len(proposal), accepted, new, rollback, None, 0)
            del ctx[key][len(ctx[key]) - rollback:]
            ctx[key] += new
    # A proposal asked twice for the same context (no advance between) is the same.
    first = method.propose({"c": 5})["c"].token_ids
    assert method.propose({"c": 3})["c"].token_ids == first[:3]
    # An Advance that only asks for a proposal (no new tokens) keeps the context.
    method.advance("c", 0, 0, [], 0, None, 0)
    assert method.propose({"c": 4})["c"].token_ids == greedy_generate(draft, [ctx["c"]], 4)[0]
    with pytest.raises(ValueError, match="num_rollback_tokens"):
        method.advance("a", 0, 0, [1], len(ctx["a"]) + 1, None, 0)


def test_accepted_drafts_keep_their_kv(draft, fed):
    method = DraftModelMethod(model=draft, num_kv_blocks=64, block_size=4)
    context = prompts(1, seed=3)[0]
    method.start("s", context, [], GREEDY, max_num_speculative_tokens=8)
    d = method.propose({"s": 4})["s"].token_ids
    assert fed == [len(context), 1, 1, 1]
    # 2 of 4 accepted, then the target's own token: only that token lacks KV.
    method.advance("s", 4, 2, d[:2] + [(d[2] + 1) % VOCAB], 0, None, 0)
    fed.clear()
    d = method.propose({"s": 3})["s"].token_ids
    assert fed == [1, 1, 1]
    # All 3 accepted plus a bonus: the last draft was never fed, so it and the bonus are.
    method.advance("s", 3, 3, d + [5], 0, None, 0)
    fed.clear()
    d = method.propose({"s": 2})["s"].token_ids
    assert fed == [2, 1]
    # A rewind of 3 committed tokens, then one new token: KV up to the rewind point holds.
    method.advance("s", 0, 0, [7], 3, None, 0)
    fed.clear()
    method.propose({"s": 1})
    assert fed == [1]


def test_sampled_proposals_carry_q_shaped_like_the_verifiers_p(draft):
    method = DraftModelMethod(model=draft, num_kv_blocks=64, sample=True)
    assert method.info().returns_probs
    context = prompts(1, seed=4)[0]
    sampling = SamplingParams(temperature=0.7, top_k=5, seed=123)
    method.start("t", context, [], sampling, max_num_speculative_tokens=8)
    method.start("g", context, [], GREEDY, max_num_speculative_tokens=8)  # greedy in the same batch
    drafts = method.propose({"t": 6, "g": 3})
    assert drafts["g"].probs is None
    assert drafts["g"].token_ids == greedy_generate(draft, [context], 3)[0]
    tokens, q = drafts["t"].token_ids, drafts["t"].probs
    assert q.shape == (6, VOCAB) and q.dtype == torch.float32
    torch.testing.assert_close(q.sum(-1), torch.ones(6), atol=1e-5, rtol=0)
    assert all(q[i, tok] > 0 for i, tok in enumerate(tokens))
    assert ((q > 0).sum(-1) == 5).all()  # top-k support
    # Each row is the verifier's p-transformation of the draft model's logits there.
    params = SamplingParams(temperature=0.7, top_k=5)
    metadata = SamplingMetadata.from_params([params], [None], torch.Generator())
    for i in range(6):
        cache = draft.make_kv_cache(16, 16)
        cache.add(0)
        ids = context + tokens[:i]
        logits = draft(torch.tensor(ids), cache.plan([(0, len(ids))]), cache).logits
        ref = apply_sampling(logits, metadata, torch.tensor([1]))[0]
        torch.testing.assert_close(q[i], ref, atol=1e-6, rtol=1e-5)
    # The seed makes the proposal reproducible; another seed changes it.
    again = DraftModelMethod(model=draft, num_kv_blocks=64, sample=True)
    again.start("t", context, [], sampling, max_num_speculative_tokens=8)
    replay = again.propose({"t": 6})["t"]
    assert replay.token_ids == tokens
    torch.testing.assert_close(replay.probs, q)
    others = set()
    for seed in range(5):
        again.start("t", context, [], SamplingParams(temperature=0.7, top_k=5, seed=seed), 8)
        others.add(tuple(again.propose({"t": 6})["t"].token_ids))
    assert len(others) > 1
    # Without sample=True, a sampled request gets greedy drafts and no q.
    plain = DraftModelMethod(model=draft, num_kv_blocks=64)
    plain.start("t", context, [], sampling, max_num_speculative_tokens=8)
    assert plain.propose({"t": 3})["t"] == drafts["g"]


def test_no_room_means_no_proposal_and_free_returns_blocks(draft):
    method = DraftModelMethod(model=draft, num_kv_blocks=6, block_size=4)  # 24 tokens
    method.start(
        "long", list(range(22)), [], GREEDY, max_num_speculative_tokens=8
    )  # 22 + 3 tokens: 7 blocks
    method.start("short", [1, 2, 3], [], GREEDY, max_num_speculative_tokens=8)
    drafts = method.propose({"long": 4, "short": 4})
    assert set(drafts) == {"short"} and len(drafts["short"].token_ids) == 4
    method.free("short")
    assert len(method.propose({"long": 1})["long"].token_ids) == 1  # 22 tokens: 6 blocks
    for key in ("long", "short", "unknown"):
        method.free(key)
    assert method.cache.num_free_blocks == 6 and method.num_sequences == 0
    assert not method.has("long")


def test_no_draft_past_max_model_len(draft):
    method = DraftModelMethod(model=draft, num_kv_blocks=32, block_size=4, max_model_len=30)
    assert method.info().max_model_len == 30
    method.start("near", list(range(27)), [], GREEDY, max_num_speculative_tokens=8)
    method.start("full", list(range(30)), [], GREEDY, max_num_speculative_tokens=8)
    drafts = method.propose({"near": 8, "full": 2})
    assert set(drafts) == {"near"} and len(drafts["near"].token_ids) == 3


# -- CUDA graphs (tests/drafter/test_draft_model_graphs.py) ------------------------


def test_no_cuda_graphs_reaches_the_method(tmp_path):
    args = build_parser().parse_args(["--method", "draft_model", "--model", str(tmp_path)])
    assert args.cuda_graphs is None  # the method's default: graphs on a GPU
    args = build_parser().parse_args(["--method", "draft_model", "--model", str(tmp_path),
                                      "--no-cuda-graphs"])
    with pytest.raises(ValueError, match="config.json"):  # reached the constructor, keyword known
        build_method(args)
    assert "cuda_graphs" in registry.method_options("draft_model")


# -- Hugging Face directories ----------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "/nonexistent/draft"], "draft model /nonexistent/draft: not a directory"),
    (["--model", "/m", "--ngram-min", "2"], "--ngram-min does not apply to method 'draft_model'"),
    ([], "give exactly one of model_dir"),
])
def test_bad_command_lines_exit_2_with_a_message(argv, message, capsys):
    assert main(["--method", "draft_model", *argv]) == 2
    assert message in capsys.readouterr().err


def test_draft_options_do_not_apply_to_ngram(capsys):
    assert main(["--method", "ngram", "--sample-drafts"]) == 2
    assert "--sample-drafts does not apply to method 'ngram'" in capsys.readouterr().err


def _hf_draft_dir(path, smollm2_dir, vocab_size: int, extra_token: bool = False):
    """A tiny random Llama saved as Hugging Face does, with SmolLM2's tokenizer
    (plus one added token when extra_token)."""
    from transformers import AutoTokenizer, LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    HFLlama(LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=256)).save_pretrained(path)
    if extra_token:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        tokenizer.add_tokens(["<draft-only>"])
        tokenizer.save_pretrained(path)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.mark.model
def test_model_directory_with_the_targets_tokenizer(tmp_path, smollm2_dir):
    from specdec.models import load_model
    from specdec.tokenizer import Tokenizer

    fingerprint = Tokenizer.from_dir(smollm2_dir).fingerprint()
    path = _hf_draft_dir(tmp_path / "tiny-draft", smollm2_dir, fingerprint[0])
    method = DraftModelMethod(model_dir=path, target_dir=smollm2_dir, dtype="float64",
                              num_kv_blocks=16)
    info = method.info()
    assert (info.vocab_size, info.tokenizer_hash) == fingerprint
    assert info.model_name == "tiny-draft" and info.max_model_len == 256
    assert method.model.dtype == torch.float64
    target = TargetInfo(fingerprint[0], fingerprint[1], 576, 30)
    assert check_info(_info_proto(info), target) is None
    context = [1, 504, 2000, 42, 9]
    method.start("s", context, [], GREEDY, max_num_speculative_tokens=8)
    reference = load_model(path, dtype="float64")
    assert method.propose({"s": 5})["s"].token_ids == greedy_generate(reference, [context], 5)[0]
    # The command line reaches the same method, --target included.
    args = build_parser().parse_args([
        "--method", "draft_model", "--model", str(path), "--target", str(smollm2_dir),
        "--dtype", "float64", "--num-kv-blocks", "8", "--max-model-len", "100",
        "--sample-drafts", "--max-num-speculative-tokens", "4"])
    cli = build_method(args)
    assert isinstance(cli, DraftModelMethod) and cli.model.dtype == torch.float64
    assert cli.cache.num_free_blocks == 8
    info = cli.info()
    assert (info.vocab_size, info.tokenizer_hash) == fingerprint
    assert (info.max_model_len, info.max_num_speculative_tokens, info.returns_probs) == (100, 4, True)


@pytest.mark.model
def test_mismatches_are_refused_naming_both_sides(tmp_path, smollm2_dir, capsys):
    from specdec.tokenizer import Tokenizer

    vocab, digest = Tokenizer.from_dir(smollm2_dir).fingerprint()
    other = _hf_draft_dir(tmp_path / "other-tok", smollm2_dir, vocab + 1, extra_token=True)
    with pytest.raises(ValueError, match=rf"tokenizer mismatch: draft model .*other-tok has vocab "
                                         rf"{vocab + 1} hash \w+\.\.\., target .*"
                                         rf"{smollm2_dir.name} has vocab {vocab} hash "
                                         rf"{digest[:16]}"):
        DraftModelMethod(model_dir=other, target_dir=smollm2_dir, num_kv_blocks=4)
    assert main(["--method", "draft_model", "--model", str(other), "--target",
                 str(smollm2_dir)]) == 2
    assert "error: tokenizer mismatch: draft model" in capsys.readouterr().err
    # Without --target it serves, and the verifier refuses it at connect time.
    info = DraftModelMethod(model_dir=other, num_kv_blocks=4).info()
    assert info.vocab_size == vocab + 1 and info.tokenizer_hash not in ("", digest)
    problem = check_info(_info_proto(info), TargetInfo(vocab, digest, 576, 30))
    assert problem is not None and "tokenizer mismatch" in problem

    padded = _hf_draft_dir(tmp_path / "padded", smollm2_dir, vocab + 8)
    with pytest.raises(ValueError, match=rf"vocab size mismatch: draft model .*padded has "
                                         rf"{vocab + 8} logits, target .* has {vocab}"):
        DraftModelMethod(model_dir=padded, target_dir=smollm2_dir, num_kv_blocks=4)
    # Padded logits alone: vocab_size is the logit count, the hash is not comparable.
    info = DraftModelMethod(model_dir=padded, num_kv_blocks=4).info()
    assert (info.vocab_size, info.tokenizer_hash) == (vocab + 8, "")

    small = _hf_draft_dir(tmp_path / "small", smollm2_dir, 1000)
    with pytest.raises(ValueError, match=rf"small: its tokenizer has {vocab} tokens but the "
                                         r"model only 1000 logits"):
        DraftModelMethod(model_dir=small, num_kv_blocks=4)


def _info_proto(info) -> drafter_pb2.InfoResponse:
    from drafter.service import info_to_proto

    return info_to_proto(info, 0)


# -- behind a real verifier ------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 8])
def test_output_equals_plain_greedy_behind_the_verifier(loop, model, draft, batch):  # noqa: F811
    methods = {"self": DraftModelMethod(model=model, num_kv_blocks=300),
               "other": DraftModelMethod(model=draft, num_kv_blocks=300)}
    stack = Stack(loop, model, methods)
    try:
        ps = prompts(batch, seed=20 + batch)
        expected = greedy_generate(model, ps, 40)
        for name in methods:
            msgs = [start_msg(p, 40, k=1 + (i + 3) % K_MAX, drafter=name)
                    for i, p in enumerate(ps)]
            results = run_concurrently(lambda m: generate(stack.stub, m), [(m,) for m in msgs])
            for (tokens, responses), want in zip(results, expected, strict=True):
                assert tokens == want, name
                spec = responses[-1].spec_decode
                assert spec.num_draft_tokens > 0, name
                if name == "self":  # the target drafting for itself is always right
                    assert spec.num_accepted_tokens == spec.num_draft_tokens
                    assert len(responses) < 40
    finally:
        stack.close()
    # Every stream has ended: every sequence freed, every KV block back.
    for method in methods.values():
        _wait_for(lambda m=method: m.num_sequences == 0)
        assert method.cache.num_free_blocks == 300


def test_sampled_self_draft_is_always_accepted(loop, model):  # noqa: F811
    # q equals p (same model, same shaping), so min(1, p/q) = 1 for every draft.
    # Unseeded: a seeded request's drafts are judged against its position-keyed token
    # instead (verifier/sampling/sampler.py), which a sample of q matches only by chance.
    method = DraftModelMethod(model=model, num_kv_blocks=300, sample=True)
    stack = Stack(loop, model, {"self": method})
    try:
        sampling = common_pb2.SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
        msgs = [start_msg(p, 30, k=4, drafter="self", sampling=sampling)
                for p in prompts(4, seed=30)]
        results = run_concurrently(lambda m: generate(stack.stub, m), [(m,) for m in msgs])
        for tokens, responses in results:
            assert len(tokens) == 30
            spec = responses[-1].spec_decode
            assert spec.num_draft_tokens > 0
            assert spec.num_accepted_tokens == spec.num_draft_tokens
    finally:
        stack.close()
    _wait_for(lambda: method.num_sequences == 0)
    assert method.cache.num_free_blocks == 300
