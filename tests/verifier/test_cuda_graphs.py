"""The CUDA-graph runner: bucket choice, and on CPU (capture=False: the same
buffers and padding, the forward called instead of replayed) outputs equal
to the eager forward, padding that never touches real KV blocks, and exact
greedy output through the engine. The capture itself runs on a GPU only."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.generate import greedy_generate
from specdec.models import LlamaForCausalLM, PagedKVCache
from specdec.models.cuda_graphs import (
    CudaGraphRunner,
    GraphKey,
    batch_buckets,
    bucket,
    width_buckets,
)
from tests.tiny import tiny_llama
from tests.verifier.test_engine import GREEDY, ScriptedProposer
from verifier.engine import Engine, EngineConfig, Request

VOCAB = 97
BLOCK = 4
LAYERS = (0, 2)  # hidden states asked for alongside the logits

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, seed=0)


def test_buckets():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert width_buckets(2048, 16) == [16, 32, 64, 128]
    assert width_buckets(100, 16) == [7]
    assert width_buckets(64, 4, min_context=8) == [2, 4, 8, 16]
    buckets = batch_buckets(32)
    assert [bucket(buckets, n) for n in (1, 3, 5, 9, 17, 25, 32, 33)] == [1, 4, 8, 16, 24, 32, 32, None]


def test_graph_key_picks_the_bucket_or_eager(model):
    cache = model.make_kv_cache(64, BLOCK)
    runner = CudaGraphRunner(model, cache, max_batch=6, max_query_len=5, max_model_len=64,
                             capture=False, min_context=8)
    assert runner.batch_sizes == [1, 2, 4, 6] and runner.widths == [2, 4, 8, 16]
    for s in range(7):
        cache.add(s)
    cache.plan([(s, 5 + 2 * s) for s in range(7)])  # lengths 5..17: 2..5 blocks

    def key(appends, layers=()):
        meta = cache.plan(appends)
        for s, n in appends:
            cache.truncate(s, cache.length(s) - n)
        return runner.key(meta, layers)

    assert key([(0, 1), (1, 1)]) == GraphKey(2, 1, 2, ())  # lengths 6, 8: 2 blocks
    assert key([(0, 1), (1, 1), (2, 1)]) == GraphKey(4, 1, 4, ())  # 3 -> 4 sequences; 3 -> 4 blocks
    assert key([(0, 5)], LAYERS) == GraphKey(1, 5, 4, LAYERS)
    assert key([(s, 3) for s in range(6)]) == GraphKey(6, 3, 8, ())  # 18 tokens: 5 -> 8 blocks
    assert key([(0, 2), (1, 3)]) == GraphKey(2, 3, 4, ())  # a K per sequence: padded to 3
    assert key([(0, 6)]) is None  # q past K_max + 1
    assert key([(s, 1) for s in range(7)]) is None  # more sequences than the largest bucket


def _prefill(model: LlamaForCausalLM, cache: PagedKVCache, lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    for s, n in enumerate(lengths):
        cache.add(s)
        model(torch.randint(0, VOCAB, (n,), generator=gen).to(model.device), cache.plan([(s, n)]),
              cache, logits_indices=torch.empty(0, dtype=torch.int64, device=model.device))


def check_padded_step(model: LlamaForCausalLM, runner: CudaGraphRunner, batch: int,
                      q: int | list[int], atol: float) -> None:
    """One step of q tokens (or q[s] for sequence s) for sequences 0..batch-1
    through the runner equals the eager forward (logits, hidden states, K/V
    written), and every slot but the step's own and the scratch block's stays
    as it was."""
    cache, dev = runner.cache, model.device
    qs = q if isinstance(q, list) else [q] * batch
    appends = list(enumerate(qs))
    num_tokens = sum(qs)
    ids = torch.randint(0, VOCAB, (num_tokens,),
                        generator=torch.Generator().manual_seed(num_tokens)).to(dev)
    before_k, before_v = cache.k.clone(), cache.v.clone()

    meta = cache.plan(appends)
    rows = torch.arange(num_tokens, device=dev)
    eager = model(ids, meta, cache, logits_indices=rows, hidden_layers=LAYERS)
    eager_k, eager_v = cache.k[:, meta.slot_mapping].clone(), cache.v[:, meta.slot_mapping].clone()
    for s, n in appends:
        cache.truncate(s, cache.length(s) - n)
    cache.k.copy_(before_k)
    cache.v.copy_(before_v)

    meta = cache.plan(appends)
    key = runner.key(meta, LAYERS)
    assert key.batch >= batch and key.batch in runner.batch_sizes
    runs = runner.num_runs
    subset = torch.arange(0, num_tokens, 2, device=dev)  # hidden states at some rows, as the engine asks
    out = runner.run(ids, meta, LAYERS, subset)
    assert runner.num_runs == runs + 1
    torch.testing.assert_close(out.logits, eager.logits, rtol=0, atol=atol)
    assert torch.equal(out.argmax, out.logits.argmax(-1))  # taken in the graph, rows mapped
    torch.testing.assert_close(out.hidden_states, eager.hidden_states[:, subset], rtol=0, atol=atol)
    # The step's own slots hold the same K/V as after the eager step ...
    torch.testing.assert_close(cache.k[:, meta.slot_mapping], eager_k, rtol=0, atol=atol)
    torch.testing.assert_close(cache.v[:, meta.slot_mapping], eager_v, rtol=0, atol=atol)
    # ... and every other slot but the scratch block is untouched.
    untouched = torch.ones(cache.k.shape[1], dtype=torch.bool, device=dev)
    untouched[meta.slot_mapping] = False
    scratch = runner.scratch_block * cache.block_size
    untouched[scratch: scratch + cache.block_size] = False
    assert torch.equal(cache.k[:, untouched], before_k[:, untouched])
    assert torch.equal(cache.v[:, untouched], before_v[:, untouched])
    for s, n in appends:
        cache.truncate(s, cache.length(s) - n)


@pytest.mark.parametrize("q", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3, 4, 7])
def test_padded_step_equals_eager_and_leaves_real_blocks_alone(model, batch, q):
    cache = model.make_kv_cache(96, BLOCK)
    runner = CudaGraphRunner(model, cache, max_batch=8, max_query_len=5, max_model_len=64,
                             capture=False, min_context=8)
    rng = random.Random(batch * 10 + q)
    _prefill(model, cache, [rng.randint(1, 40) for _ in range(batch)])
    scratch = runner.scratch_block * BLOCK
    before = cache.k[:, scratch].clone()
    check_padded_step(model, runner, batch, q, atol=1e-12)
    if batch not in runner.batch_sizes:  # padded: the padding rows wrote the scratch block
        assert not torch.equal(cache.k[:, scratch], before)


@pytest.mark.parametrize("qs", [[1, 5, 3], [2, 1], [5, 1, 1, 4, 2, 3, 1]], ids=str)
def test_ragged_step_pads_each_sequence_and_equals_eager(model, qs):
    """A K per sequence: each sequence is padded to the longest, and its padding
    writes only the scratch block."""
    cache = model.make_kv_cache(96, BLOCK)
    runner = CudaGraphRunner(model, cache, max_batch=8, max_query_len=5, max_model_len=64,
                             capture=False, min_context=8)
    rng = random.Random(len(qs))
    _prefill(model, cache, [rng.randint(1, 40) for _ in qs])
    scratch = runner.scratch_block * BLOCK
    before = cache.k[:, scratch].clone()
    check_padded_step(model, runner, len(qs), qs, atol=1e-12)
    assert not torch.equal(cache.k[:, scratch], before)  # the padding rows wrote there


def test_shapes_outside_the_buckets_are_left_to_the_eager_path(model):
    cache = model.make_kv_cache(64, BLOCK)
    runner = CudaGraphRunner(model, cache, max_batch=4, max_query_len=3, max_model_len=32,
                             capture=False)
    _prefill(model, cache, [5, 9])
    meta = cache.plan([(0, 1), (1, 4)])  # 4 tokens: past K_max + 1
    assert runner.run(torch.zeros(5, dtype=torch.int64), meta) is None
    assert runner.num_runs == 0 and not runner.graphs


def _engine_with_runner(model: LlamaForCausalLM, proposer, **cfg) -> Engine:
    """An engine on CPU with the runner a GPU engine makes, forward called instead of replayed."""
    engine = Engine(model, EngineConfig(**cfg), proposer)
    c = engine.config
    engine.runner.graphs = CudaGraphRunner(model, engine.cache, c.max_num_seqs,
                                    c.max_num_speculative_tokens + 1, c.max_model_len,
                                    capture=False, min_context=16)
    return engine


@pytest.mark.parametrize("k", [0, 3, "mixed"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_engine_with_padded_steps_keeps_greedy_exact(model, batch, k):
    rng = random.Random(batch + (5 if k == "mixed" else k))
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(batch)]
    max_tokens = 20
    plain = greedy_generate(model, prompts, max_tokens)
    refs = {i: p + g for i, (p, g) in enumerate(zip(prompts, plain, strict=True))}
    proposer = ScriptedProposer(refs, error_rate=0.3, seed=batch)
    engine = _engine_with_runner(model, proposer, max_num_seqs=8, max_model_len=64,
                                 block_size=BLOCK, num_kv_blocks=256, max_num_speculative_tokens=4)
    free = engine.cache.num_free_blocks
    ks = [[0, 1, 2, 4][i % 4] if k == "mixed" else k for i in range(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, max_tokens, GREEDY, num_speculative_tokens=ks[i]))
    out = {f"r{i}": [] for i in range(batch)}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out[f"r{i}"] for i in range(batch)] == plain
    # Every step ran padded (mixed K too) but the first, which prefilled every prompt.
    assert engine.runner.graphs.num_runs == engine.num_steps - 1 > max_tokens // (max(ks) + 1) // 2
    assert engine.cache.num_free_blocks == free  # every real block returned


def corrupt_graph_outputs(runner: CudaGraphRunner, *, logits: bool = False,
                          argmax: bool = False) -> None:
    """Every output of the graph runner with its logits or its argmax made worthless:
    zero logits, argmax all token 0."""
    run = runner.run

    def corrupted(*args, **kwargs):
        out = run(*args, **kwargs)
        if out is not None:
            out.logits = torch.zeros_like(out.logits) if logits else out.logits
            out.argmax = torch.zeros_like(out.argmax) if argmax else out.argmax
        return out

    runner.run = corrupted


def test_a_greedy_step_reads_the_graphs_argmax_alone(model):
    """A greedy graphed step's acceptance reads nothing but the argmax taken inside the
    graph: with the logits after the graph zeroed, the engine still gives plain greedy
    decoding's tokens (drafts accepted and rejected), and with the argmax zeroed it
    does not."""
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    plain = greedy_generate(model, prompts, 16)
    refs = {i: p + g for i, (p, g) in enumerate(zip(prompts, plain, strict=True))}

    def generate(**corrupt) -> list[list[int]]:
        engine = _engine_with_runner(model, ScriptedProposer(refs, error_rate=0.3, seed=2),
                                     max_num_seqs=4, max_model_len=64, block_size=BLOCK,
                                     num_kv_blocks=128, max_num_speculative_tokens=4)
        corrupt_graph_outputs(engine.runner.graphs, **corrupt)
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", p, 16, GREEDY, num_speculative_tokens=i + 1))
        out = {f"r{i}": [] for i in range(3)}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        assert engine.runner.graphs.num_runs > 3
        return [out[f"r{i}"] for i in range(3)]

    assert generate(logits=True) == plain
    assert generate(argmax=True) != plain


def test_config_flag_and_cpu_stay_eager(model):
    assert Engine(model, EngineConfig()).runner.graphs is None  # CPU: never graphs
    assert Engine(model, EngineConfig(cuda_graphs=False)).runner.graphs is None


# -- on a GPU -------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_replayed_graphs_equal_eager_on_cuda():
    # float64: eager and replayed steps differ only by GEMM shapes (padding rows).
    model = tiny_llama(VOCAB, seed=0).to("cuda")
    cache = model.make_kv_cache(128, BLOCK)
    runner = CudaGraphRunner(model, cache, max_batch=8, max_query_len=5, max_model_len=64,
                             min_context=8)
    assert runner.capture
    _prefill(model, cache, [7, 20, 33, 1, 12, 40, 25])
    for batch, q in [(3, 1), (3, 5), (3, 1), (7, 3), (1, 5), (4, 1), (3, [1, 5, 2]),
                     (7, [3, 1, 2, 3, 3, 1, 1])]:  # replays after captures
        check_padded_step(model, runner, batch, q, atol=1e-10)
    # (3, 1) and (4, 1) share a graph (4 sequences, 16 blocks); the ragged steps replay
    # the graphs of (3, 5) and (7, 3).
    assert len(runner.graphs) == 4
    engine = Engine(model, EngineConfig(max_model_len=64, block_size=BLOCK, num_kv_blocks=32))
    assert engine.runner.graphs is not None and engine.cache.num_free_blocks == 32
    assert Engine(model, EngineConfig(max_model_len=64, block_size=BLOCK, num_kv_blocks=32,
                                      cuda_graphs=False)).runner.graphs is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [0, 3, "mixed"])
def test_engine_on_cuda_with_graphs_keeps_greedy_exact(k):
    """The engine on a GPU, graphs captured and replayed (mixed K: each sequence
    padded to the longest), gives the tokens of plain greedy decoding on the
    same device."""
    model = tiny_llama(VOCAB, seed=0).to("cuda")
    rng = random.Random(7)
    batch, max_tokens = 8, 24
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(batch)]
    plain = greedy_generate(model, prompts, max_tokens)
    refs = {i: p + g for i, (p, g) in enumerate(zip(prompts, plain, strict=True))}
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=64, block_size=BLOCK,
                                        num_kv_blocks=256, max_num_speculative_tokens=4),
                    ScriptedProposer(refs, error_rate=0.3, seed=1))
    assert engine.runner.graphs is not None and engine.runner.graphs.capture
    for i, p in enumerate(prompts):
        ki = [0, 1, 2, 4][i % 4] if k == "mixed" else k
        engine.add_request(Request(f"r{i}", p, max_tokens, GREEDY, num_speculative_tokens=ki))
    out = {f"r{i}": [] for i in range(batch)}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out[f"r{i}"] for i in range(batch)] == plain
    # Every step replayed a graph (mixed K too) but the first, which prefilled every prompt.
    assert engine.runner.graphs.num_runs == engine.num_steps - 1 and engine.runner.graphs.graphs
