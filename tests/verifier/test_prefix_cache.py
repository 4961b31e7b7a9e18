"""Prefix caching in the engine (float64 tiny model): greedy output is identical
with the cache on and off, and equal to plain decoding, while the cache hits and
the target computes fewer tokens: a shared system prompt, a second conversation
turn, drafts rejected across a block boundary, eviction from a small pool,
preemption, and a drafter that reads hidden states."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from specdec.generate import greedy_generate
from specdec.models import LlamaForCausalLM
from specdec.sampling import SamplingParams
from tests.tiny import tiny_llama
from tests.verifier.test_engine import HiddenRecorder, ScriptedProposer
from verifier.__main__ import build_parser
from verifier.engine import Engine, EngineConfig, Proposal, Request

VOCAB = 97
BS = 4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, seed=0)


@contextmanager
def fed_tokens(model: LlamaForCausalLM):
    """Counts the tokens the target runs through its layers (every forward's input)."""
    count = [0]
    handle = model.embed_tokens.register_forward_hook(
        lambda _m, args, _out: count.__setitem__(0, count[0] + args[0].numel()))
    try:
        yield count
    finally:
        handle.remove()


def run_waves(engine: Engine, waves: list[list[Request]]) -> dict[str, list[int]]:
    """Each wave is added once the previous one finished (so its blocks are cached)."""
    out: dict[str, list[int]] = {}
    for wave in waves:
        for r in wave:
            engine.add_request(r)
            out[r.request_id] = []
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
    return out


def engine_for(model, enable: bool, proposer=None, **kw) -> Engine:
    cfg = dict(max_num_seqs=8, max_model_len=128, block_size=BS, num_kv_blocks=256,
               max_num_batched_tokens=64, max_num_speculative_tokens=8)
    return Engine(model, EngineConfig(**{**cfg, **kw}, enable_prefix_caching=enable), proposer)


def both(model, waves_of, proposer_of=lambda: None, **kw):
    """Run the same waves with the cache on and off. Returns per setting its outputs,
    the engine and the tokens the target computed."""
    results = {}
    for enable in (True, False):
        engine = engine_for(model, enable, proposer_of(), **kw)
        with fed_tokens(model) as fed:
            out = run_waves(engine, waves_of())
        results[enable] = (out, engine, fed[0])
    return results


def test_shared_system_prompt(model):
    rng = random.Random(1)
    system = [rng.randrange(VOCAB) for _ in range(22)]  # 5 full blocks and a partial one
    users = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    prompts = [system + u for u in users]
    plain = greedy_generate(model, prompts, 12)

    def waves():
        reqs = [Request(f"r{i}", p, 12, GREEDY) for i, p in enumerate(prompts)]
        return [reqs[:1], reqs[1:]]

    res = both(model, waves)
    for enable in (True, False):
        assert [res[enable][0][f"r{i}"] for i in range(6)] == plain
    stats = res[True][1].scheduler.prefix_cache_stats
    assert stats.hits == 5 * 20  # five more requests, each five full system blocks
    assert res[True][2] == res[False][2] - stats.hits
    assert res[False][1].scheduler.prefix_cache_stats.queries == 0
    assert res[True][1].cache.num_free_blocks == 256


def test_second_turn_reuses_the_first(model):
    """Turn 2's prompt is turn 1's prompt, its reply and new user text; turn 1 has
    finished, so its blocks sit in the evictable LRU. Turn 1 speculates, so some of
    its committed blocks were written by verify steps."""
    rng = random.Random(2)
    p1 = [rng.randrange(VOCAB) for _ in range(9)]
    r1 = greedy_generate(model, [p1], 15)[0]
    p2 = p1 + r1 + [rng.randrange(VOCAB) for _ in range(5)]
    r2 = greedy_generate(model, [p2], 10)[0]
    refs = {0: p1 + r1, 1: p2 + r2}

    def waves():
        return [[Request("t1", p1, 15, GREEDY, num_speculative_tokens=3)],
                [Request("t2", p2, 10, GREEDY, num_speculative_tokens=3)]]

    res = both(model, waves, lambda: ScriptedProposer(refs, error_rate=0.4, seed=2))
    for enable in (True, False):
        assert res[enable][0] == {"t1": r1, "t2": r2}
    # Turn 1's KV held p1 + r1 but r1's last token (never fed): its full blocks hit.
    assert res[True][1].scheduler.prefix_cache_stats.hits == (len(p1) + len(r1) - 1) // BS * BS
    assert res[True][2] < res[False][2]


class BoundaryProposer(ScriptedProposer):
    """Drafts the right tokens up to and one past the next block boundary, then wrong
    ones: every verify writes into a fresh block and rolls part of it back."""

    def propose(self, wanted, tokens):
        out = {}
        for seq_id, k in wanted.items():
            ref, n = self.references[seq_id], len(tokens[seq_id])
            # Position n - 1 is the last token; drafts sit at n, n + 1, ...
            right = (BS - n % BS) % BS + 1
            draft = [(ref[n + i] if n + i < len(ref) else 0) if i < right
                     else (ref[n + i] + 1) % VOCAB if n + i < len(ref) else 1 for i in range(k)]
            out[seq_id] = Proposal(draft)
        return out


def test_rejected_drafts_across_a_block_boundary_leave_shared_blocks_intact(model):
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(13)]  # 3 full blocks and one token
    tails = [[rng.randrange(VOCAB)] for _ in range(3)]
    prompts = [prompt] + [prompt[:12] + t for t in tails]
    plain = greedy_generate(model, prompts, 20)
    refs = {i: p + g for i, (p, g) in enumerate(zip(prompts, plain, strict=True))}

    def waves():
        reqs = [Request(f"r{i}", p, 20, GREEDY, num_speculative_tokens=6)
                for i, p in enumerate(prompts)]
        return [reqs[:1], reqs[1:]]

    # Wave 2 shares r0's three prompt blocks; record them before and check them after.
    engine = engine_for(model, True, BoundaryProposer(refs, 0.0))
    ws = waves()
    out = run_waves(engine, ws[:1])
    shared = [b for b in range(engine.cache.pool.num_blocks) if engine.cache.pool.is_registered(b)]
    for r in ws[1]:
        engine.add_request(r)
        out[r.request_id] = []
    for o in engine.step():  # admits wave 2 on the cached blocks and prefills the rest
        out[o.request_id] += o.new_token_ids
    blocks = engine.cache.blocks(1)[:3]
    assert set(blocks) <= set(shared) and all(engine.cache.pool.refcount[b] == 3 for b in blocks)
    slots = torch.tensor([b * BS + i for b in blocks for i in range(BS)])
    snapshot = (engine.cache.k[:, slots].clone(), engine.cache.v[:, slots].clone())
    drafted = accepted = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            drafted, accepted = drafted + o.num_drafted, accepted + o.num_accepted
    assert [out[f"r{i}"] for i in range(4)] == plain
    assert 0 < accepted < drafted
    assert torch.equal(engine.cache.k[:, slots], snapshot[0])
    assert torch.equal(engine.cache.v[:, slots], snapshot[1])
    assert engine.scheduler.prefix_cache_stats.hits == 3 * 12

    res = both(model, waves, lambda: BoundaryProposer(refs, 0.0))
    assert res[True][0] == res[False][0] == {f"r{i}": g for i, g in enumerate(plain)}


def test_eviction_from_a_small_pool_is_lru_and_recomputes_correctly(model):
    """A pool of 12 blocks holds one finished prompt's blocks beside a running one: older
    prompts are evicted, least recently used first, and computed again when asked."""
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(17)] for _ in range(4)]  # 4 full blocks + 1
    order = [0, 1, 2, 3, 3, 0]  # 3 again: still cached; 0 again: long evicted
    plain = greedy_generate(model, [prompts[i] for i in order], 6)

    def waves():
        return [[Request(f"w{j}", prompts[i], 6, GREEDY)] for j, i in enumerate(order)]

    res = both(model, waves, num_kv_blocks=12, max_model_len=32)
    for enable in (True, False):
        assert [res[enable][0][f"w{j}"] for j in range(len(order))] == plain
    engine = res[True][1]
    assert engine.cache.pool.num_evictions > 0
    assert engine.scheduler.prefix_cache_stats.hits == 16  # prompt 3's second run only
    assert res[True][2] == res[False][2] - 16


def test_preempted_sequences_recompute_from_the_cache(model):
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(12)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
               for _ in range(6)]
    plain = greedy_generate(model, prompts, 24)

    def waves():
        reqs = [Request(f"r{i}", p, 24, GREEDY) for i, p in enumerate(prompts)]
        return [reqs[:1], reqs[1:]]

    res = both(model, waves, num_kv_blocks=24, max_model_len=48, max_num_batched_tokens=16)
    for enable in (True, False):
        assert [res[enable][0][f"r{i}"] for i in range(6)] == plain
        assert res[enable][1].scheduler.num_preemptions > 0
    stats = res[True][1].scheduler.prefix_cache_stats
    # More than the five system prompts: preempted sequences found their own blocks.
    assert stats.hits > 5 * 12
    assert res[True][2] < res[False][2]


class SomeReadHidden(HiddenRecorder):
    """Hidden states for the sequences it has references for; none for the others."""

    def hidden_layers(self, seq_id):
        return self.LAYERS if seq_id in self.references else ()

    def advance(self, seq_id, outcome):
        if seq_id in self.references:
            super().advance(seq_id, outcome)


def _same_rows(on: HiddenRecorder, off: HiddenRecorder) -> None:
    assert on.rows.keys() == off.rows.keys()
    for seq_id in off.rows:
        assert on.rows[seq_id].keys() == off.rows[seq_id].keys()
        for pos, h in off.rows[seq_id].items():
            assert torch.equal(on.rows[seq_id][pos], h), (seq_id, pos)


def test_drafter_reading_hidden_states_hits_and_gets_the_same_rows(model):
    """An EAGLE-style drafter receives the same hidden states with the cache on and off:
    its sequences take cached blocks, and the rows of the positions they skipped come
    from beside the KV; a plain sequence hits their blocks too."""
    rng = random.Random(6)
    system = [rng.randrange(VOCAB) for _ in range(16)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(3)] for _ in range(3)]
    plain = greedy_generate(model, prompts, 12)
    refs = {i: p + g for i, (p, g) in enumerate(zip(prompts, plain, strict=True))}

    def waves():
        reqs = [Request(f"r{i}", p, 12, GREEDY, num_speculative_tokens=4)
                for i, p in enumerate(prompts)]
        return [reqs[:1], reqs[1:]]

    recorders = []

    def recorder():
        recorders.append(SomeReadHidden(refs))
        return recorders[-1]

    res = both(model, waves, recorder)
    assert res[True][0] == res[False][0] == {f"r{i}": g for i, g in enumerate(plain)}
    _same_rows(*recorders)
    engine = res[True][1]
    assert engine.scheduler.prefix_cache_stats.hits == 2 * 16  # the second wave's system prompt

    # A request without a drafter, after them, reuses the blocks they registered.
    out = run_waves(engine, [[Request("plain", prompts[0], 12, GREEDY)]])
    assert out["plain"] == plain[0]
    assert engine.scheduler.prefix_cache_stats.hits == 3 * 16


def test_blocks_without_features_are_no_hits_for_a_drafter_reading_them(model):
    """Blocks a plain sequence registered carry no hidden-state rows: a sequence whose
    drafter reads them computes those positions (and its drafter gets every row)."""
    rng = random.Random(7)
    system = [rng.randrange(VOCAB) for _ in range(32)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(3)] for _ in range(2)]
    plain = greedy_generate(model, prompts, 10)
    refs = {1: prompts[1] + plain[1]}  # seq ids count from 0: r1 reads hidden states

    def waves():
        return [[Request("r0", prompts[0], 10, GREEDY)],
                [Request("r1", prompts[1], 10, GREEDY, num_speculative_tokens=3)]]

    recorders = []

    def recorder():
        recorders.append(SomeReadHidden(refs))
        return recorders[-1]

    res = both(model, waves, recorder)
    assert res[True][0] == res[False][0] == {"r0": plain[0], "r1": plain[1]}
    _same_rows(*recorders)
    assert recorders[0].rows[1].keys() >= set(range(len(prompts[1])))
    assert res[True][1].scheduler.prefix_cache_stats.hits == 0


def test_the_flag_turns_it_off():
    assert build_parser().parse_args([]).enable_prefix_caching is True
    assert build_parser().parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert EngineConfig().enable_prefix_caching is True
