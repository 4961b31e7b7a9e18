"""Rejection sampler: greedy exactness, sampled outputs follow the target distribution,
seeded reproducibility, the Triton kernel equals the torch reference bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.sampling import SamplingMetadata, SamplingParams, apply_sampling
from verifier.sampling import rejection_triton, sampler
from verifier.sampling.rejection import (
    PLACEHOLDER_TOKEN_ID,
    draw_random,
    greedy_accept,
    greedy_chains,
    rejection_sample_from_random,
)
from verifier.sampling.rejection_triton import (
    HAS_TRITON,
    rejection_sample_from_random_triton,
)
from verifier.sampling.sampler import rejection_sample

# A CUDA device runs the Triton kernel (when triton is installed) and device generators.
ON_CUDA = [pytest.mark.gpu,
           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def ragged(num_draft_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index of each request's first target row [B] and the K tensor [B]."""
    k = torch.tensor(num_draft_tokens, dtype=torch.int64)
    return k.cumsum(0) - k + torch.arange(len(k)), k


# --- greedy ------------------------------------------------------------------------


def argmax_walk(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """What greedy decoding emits given K drafts: accept while draft == argmax, then argmax."""
    out = []
    for j, x in enumerate(drafts):
        best = int(logits[j].argmax())
        out.append(best)
        if best != x:
            return out
    return out + [int(logits[len(drafts)].argmax())]


@pytest.mark.parametrize("dense_q", [False, True])
def test_greedy_is_the_argmax_walk(dense_q):
    gen = torch.Generator().manual_seed(0)
    vocab_size = 50
    counts = [3, 3, 0, 4, 1]
    row_start, k = ragged(counts)
    logits = torch.randn(int(k.sum()) + len(counts), vocab_size, generator=gen)
    argmax = logits.argmax(-1)
    drafts = []
    for i, n in enumerate(counts):
        right = argmax[row_start[i] : row_start[i] + n].tolist()
        if i == 1:  # first draft right, second wrong
            right[1] = (right[1] + 1) % vocab_size
        if i == 4:  # the only draft wrong
            right[0] = (right[0] + 7) % vocab_size
        drafts.append(right)
    draft_ids = torch.tensor(sum(drafts, []), dtype=torch.int64)
    q = torch.rand(len(draft_ids), vocab_size, generator=gen).softmax(-1) if dense_q else None

    out, num_accepted = rejection_sample(logits, draft_ids, q, k, SamplingMetadata.make_dummy(
        len(counts), temperature=0.0))

    assert out.shape == (len(counts), max(counts) + 1)
    for i, n in enumerate(counts):
        expected = argmax_walk(logits[row_start[i] : row_start[i] + n + 1], drafts[i])
        row = out[i].tolist()
        assert row == expected + [PLACEHOLDER_TOKEN_ID] * (out.shape[1] - len(expected))
        assert int(num_accepted[i]) == len(expected) - 1
    assert num_accepted.tolist() == [3, 1, 0, 4, 0]  # all right -> K + 1 tokens with the bonus


def test_greedy_requests_ignore_sampled_neighbours():
    gen = torch.Generator().manual_seed(1)
    vocab_size, counts = 40, [2, 3, 2]
    row_start, k = ragged(counts)
    logits = torch.randn(int(k.sum()) + 3, vocab_size, generator=gen)
    drafts = torch.randint(0, vocab_size, (int(k.sum()),), generator=gen)
    drafts[0] = logits[0].argmax()  # request 0 gets its first draft right
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5),
              SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.from_params(params, [None] * 3, torch.Generator().manual_seed(0))
    out, _ = rejection_sample(logits, drafts, None, k, meta)
    for i in (0, 2):
        expected = argmax_walk(logits[row_start[i] :], drafts[k[:i].sum() :][: counts[i]].tolist())
        assert out[i, : len(expected)].tolist() == expected


@pytest.mark.parametrize("counts", [[0, 3, 4, 1, 5, 2, 0, 3], [0, 0, 0], [2]])
def test_greedy_shortcut_equals_the_general_function(counts):
    """An all-greedy batch skips the sampled token's probabilities and noise; what it
    returns is what the general function returns for the same batch, K = 0 rows and
    an all-plain step included."""
    gen = torch.Generator().manual_seed(4)
    vocab_size = 300
    row_start, k = ragged(counts)
    logits = torch.randn(int(k.sum()) + len(counts), vocab_size, generator=gen)
    argmax = logits.argmax(-1)
    draft_rows = torch.cat([torch.arange(s, s + n, dtype=torch.int64)
                            for s, n in zip(row_start.tolist(), counts, strict=True)])
    # Mostly right, so that acceptance runs deep, sometimes the bonus row.
    drafts = torch.where(torch.rand(len(draft_rows), generator=gen) < 0.8, argmax[draft_rows],
                         torch.randint(0, vocab_size, (len(draft_rows),), generator=gen))
    meta = SamplingMetadata.make_dummy(len(counts), temperature=0.0)
    uniform, exp_noise = draw_random(k, vocab_size, meta)
    want = rejection_sample_from_random(logits, argmax, drafts, None, k, meta.is_greedy,
                                        uniform, exp_noise)
    got = greedy_accept(argmax, drafts, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(rejection_sample(logits, drafts, None, k, meta)[0], want[0])


@pytest.mark.parametrize("counts", [[0, 3, 4, 1, 5, 2, 0, 3], [0, 0, 0], [2]])
def test_greedy_chains_as_lists_equal_greedy_accept(counts):
    """The engine's all-greedy path reads the same tokens as greedy_accept, as lists:
    each chain's kept drafts and the token after them, and how many it kept."""
    gen = torch.Generator().manual_seed(5)
    vocab_size = 300
    row_start, k = ragged(counts)
    logits = torch.randn(int(k.sum()) + len(counts), vocab_size, generator=gen)
    argmax = logits.argmax(-1)
    # Mostly right, so that chains run deep and some keep every draft.
    drafts = [[int(argmax[s + j]) if torch.rand(1, generator=gen) < 0.8
               else int(torch.randint(0, vocab_size, (1,), generator=gen)) for j in range(n)]
              for s, n in zip(row_start.tolist(), counts, strict=True)]
    want_ids, want_accepted = greedy_accept(
        argmax, torch.tensor(sum(drafts, []), dtype=torch.int64), k)
    token_ids, num_accepted = greedy_chains(argmax.tolist(), drafts)
    assert num_accepted == want_accepted.tolist()
    assert token_ids == [row[: a + 1] for row, a in zip(want_ids.tolist(), num_accepted,
                                                          strict=True)]


# --- distribution ------------------------------------------------------------------

VOCAB = 6
NUM_SAMPLES = 20_000


def markov_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [V, V] and draft probabilities [V, V]; row = previous token."""
    gen = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(VOCAB, VOCAB, generator=gen)
    # Near the target, as a useful draft is, so that drafts are often accepted.
    draft_probs = (target_logits + torch.randn(VOCAB, VOCAB, generator=gen)).softmax(-1)
    return target_logits, draft_probs


def filtered_table(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                   min_p: float) -> torch.Tensor:
    """The target distribution each row defines, written out independently of the sampler."""
    table = torch.zeros_like(logits, dtype=torch.float64)
    for prev, row in enumerate(logits.double()):
        probs = (row / temperature).softmax(-1)
        keep = [v for v in range(len(row)) if probs[v] >= min_p * probs.max()]
        keep.sort(key=lambda v: -probs[v])
        if top_k > 0:
            keep = keep[:top_k]
        mass = sum(probs[v] for v in keep)
        kept_mass, top = 0.0, []
        for v in keep:  # the smallest top set whose renormalised mass reaches top_p
            if kept_mass >= top_p:
                break
            top.append(v)
            kept_mass += probs[v] / mass
        for v in top:
            table[prev, v] = probs[v]
        table[prev] /= table[prev].sum()
    return table


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(observed) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # the chi-square survival function


@pytest.mark.parametrize("dense_q", [False, True], ids=["one_hot_q", "dense_q"])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 4, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.15)],
    ids=["plain", "t0.7_topk4", "topp0.8", "t1.3_minp0.15"],
)
@pytest.mark.parametrize("device", ["cpu", "cpu_race", pytest.param("cuda", marks=ON_CUDA)])
def test_two_tokens_follow_the_target(dense_q, temperature, top_k, top_p, min_p, device,
                                      monkeypatch):
    """One step with drafts from q; the first two tokens must be ~ p(t1) p(t2 | t1).

    20,000 requests draft K=2; 10,000 more, interleaved, draft K=1, so that their second
    token is the bonus token whenever the draft is accepted. A CPU samples the final token
    by the inverse CDF; cpu_race makes it run the exponential race, a GPU's form.
    """
    if device == "cpu_race":
        device = "cpu"
        monkeypatch.setattr(sampler, "draw_random",
                            lambda k, vocab, meta, race: draw_random(k, vocab, meta, True))
    target_logits, q_table = markov_tables()
    p_table = filtered_table(target_logits, temperature, top_k, top_p, min_p)  # [V, V]
    gen = torch.Generator().manual_seed(7)
    prev = 0
    k = torch.tensor([2, 2, 1]).repeat(NUM_SAMPLES // 2)  # [n]
    n = len(k)

    x1 = torch.multinomial(q_table[prev], n, replacement=True, generator=gen)  # [n]
    x2 = torch.multinomial(q_table[x1], 1, generator=gen)[:, 0]  # [n]
    prevs = torch.full_like(x1, prev)
    # Ragged: request i drafts x1 (and x2); its target rows follow prev, x1 (and x2).
    is_draft = torch.arange(2) < k[:, None]  # [n, 2]
    drafts = torch.stack([x1, x2], dim=1)[is_draft]  # [sum K]
    draft_contexts = torch.stack([prevs, x1], dim=1)[is_draft]  # [sum K]
    contexts = torch.stack([prevs, x1, x2], dim=1)[torch.arange(3) < k[:, None] + 1]  # [sum K + n]
    meta = SamplingMetadata.make_dummy(n, temperature=temperature, top_k=top_k, top_p=top_p,
                                       min_p=min_p, seed=11, device=device)
    # On CUDA the Triton kernel samples (float32 probabilities, as there).
    out, num_accepted = rejection_sample(
        target_logits[contexts].to(device), drafts.to(device),
        q_table[draft_contexts].float().to(device) if dense_q else None, k.to(device), meta)
    out, num_accepted = out.cpu(), num_accepted.cpu()

    t1 = out[:, 0]
    # A rejection at the first draft emits one token; the next plain step would sample t2.
    next_plain = torch.multinomial(p_table[t1].float(), 1, generator=gen)[:, 0]
    t2 = torch.where(num_accepted >= 1, out[:, 1], next_plain)
    for num_drafts in (2, 1):
        mine = k == num_drafts
        pairs = t1[mine] * VOCAB + t2[mine]
        observed = torch.bincount(pairs, minlength=VOCAB * VOCAB).double()  # [V * V]
        expected = int(mine.sum()) * (p_table[prev][:, None] * p_table).reshape(-1)
        possible = expected > 0
        assert observed[~possible].sum() == 0, "emitted a token the target filters out"
        assert expected[possible].min() > 5  # chi-square needs populated cells
        p_value = chi_square_p_value(observed[possible], expected[possible])
        assert p_value > 1e-3, f"K={num_drafts}: p-value {p_value:.2e}"
    # Both acceptance and rejection happen, at both positions.
    assert set(num_accepted[k == 2].tolist()) == {0, 1, 2}


# --- seeds -------------------------------------------------------------------------


def build_step(requests: list[dict]):
    """Concatenate per-request (logits [K+1, V], drafts [K], q [K, V], params) into a batch."""
    logits = torch.cat([r["logits"] for r in requests])
    drafts = torch.cat([r["drafts"] for r in requests])
    q = torch.cat([r["q"] for r in requests])
    k = torch.tensor([len(r["drafts"]) for r in requests], dtype=torch.int64)
    params = [r["params"] for r in requests]
    meta = SamplingMetadata.from_params(params, [p.make_generator() for p in params],
                                        torch.Generator().manual_seed(99))
    return rejection_sample(logits, drafts, q, k, meta)


def make_request(gen: torch.Generator, num_drafts: int, vocab_size: int, params) -> dict:
    q = (torch.randn(num_drafts, vocab_size, generator=gen) * 2).softmax(-1)
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0] if num_drafts else q.new_zeros(0).long()
    # A target close to the draft, so that acceptance and rejection both happen.
    logits = torch.randn(num_drafts + 1, vocab_size, generator=gen) * 0.5
    logits[:num_drafts] += q.log()
    return {"logits": logits, "drafts": drafts, "q": q, "params": params}


def test_seeded_request_is_independent_of_its_batch():
    vocab_size = 64
    outcomes = set()
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        mine = make_request(gen, 3, vocab_size, SamplingParams(top_p=0.9, seed=1000 + seed))
        others = [
            make_request(gen, 1, vocab_size, SamplingParams()),
            make_request(gen, 0, vocab_size, SamplingParams(temperature=0.8)),
            make_request(gen, 4, vocab_size, SamplingParams(seed=5)),
            make_request(gen, 2, vocab_size, SamplingParams(temperature=0.0)),
        ]
        alone, alone_accepted = build_step([mine])
        batched, batched_accepted = build_step(others[:2] + [mine] + others[2:])
        assert batched[2, :4].tolist() == alone[0].tolist()
        assert int(batched_accepted[2]) == int(alone_accepted[0])
        outcomes.add(tuple(alone[0].tolist()))
    assert len(outcomes) > 6  # the seed, not the inputs alone, decides the output


# --- Triton ------------------------------------------------------------------------


def random_step(gen: torch.Generator, dense_q: bool, vocab_size: int = 2500):
    """Inputs of rejection_sample_from_random covering its branches.

    K_i includes 0; greedy and sampled requests mix; top-k leaves exact zeros in p; drafts
    are often the target's favourite so that acceptance runs deep. With dense q, request 1
    has q = p (always accepted) and request 2 has q = 2p (residual zero everywhere).
    """
    counts = [0, 3, 4, 1, 5, 2, 0, 3, 2, 4, 1, 3]
    row_start, k = ragged(counts)
    num_rows = int(k.sum()) + len(counts)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.0) if i % 4 == 3
        else SamplingParams(temperature=0.9, top_k=20 if i % 3 == 0 else 0, seed=i)
        for i in range(len(counts))
    ]
    meta = SamplingMetadata.from_params(params, [p.make_generator() for p in params],
                                        torch.Generator().manual_seed(0))
    target_probs = apply_sampling(logits, meta, k + 1)
    draft_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(row_start.tolist(), counts,
                                                                     strict=True)])
    drafts = torch.where(
        torch.rand(len(draft_rows), generator=gen) < 0.8,
        target_probs[draft_rows].argmax(-1),
        torch.randint(0, vocab_size, (len(draft_rows),), generator=gen),
    )
    q = None
    if dense_q:
        q = (torch.randn(len(draft_rows), vocab_size, generator=gen) * 3).softmax(-1)
        q = 0.5 * q + 0.5 * target_probs[draft_rows]
        first = int(k[:1].sum())
        q[first : first + counts[1]] = target_probs[draft_rows[first : first + counts[1]]]
        first = int(k[:2].sum())
        q[first : first + counts[2]] = 2 * target_probs[draft_rows[first : first + counts[2]]]
    uniform, exp_noise = draw_random(k, vocab_size, meta)
    return (target_probs, logits.argmax(-1), drafts, q, k, meta.is_greedy, uniform, exp_noise)


# Triton decorates its own library (tl.max, ...) when first imported, so interpret mode
# must be on before any `import triton` in the process, and in a full test run something
# (torch._dynamo, via transformers) has imported it long before this module. Without CUDA
# the comparison therefore runs in a child pytest that starts with TRITON_INTERPRET=1.
TRITON_RUNS_HERE = HAS_TRITON and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the `gpu` extra)")
def test_triton_kernel_equals_reference_interpreted():
    if TRITON_RUNS_HERE:
        pytest.skip("the kernel runs in this process: see test_triton_kernel_equals_reference")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::test_triton_kernel_equals_reference"],
        cwd=Path(__file__).parents[2],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == 0 and "4 passed" in child.stdout, child.stdout + child.stderr


@pytest.mark.skipif(
    not TRITON_RUNS_HERE, reason="no CUDA: runs in a child with TRITON_INTERPRET=1 (_interpreted)"
)
@pytest.mark.parametrize("block_v", [4096, 256], ids=["one_chunk", "ten_chunks"])
@pytest.mark.parametrize("dense_q", [False, True], ids=["one_hot_q", "dense_q"])
def test_triton_kernel_equals_reference(dense_q, block_v, monkeypatch):
    # A vocabulary of 2500 in one chunk, and in ten: the cross-chunk reduction, and a
    # last chunk that is partly past the vocabulary.
    monkeypatch.setattr(rejection_triton, "BLOCK_V", block_v)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    accepted, rejected = 0, 0
    for i in range(3):
        inputs = [x.to(device) if x is not None else None for x in random_step(gen, dense_q)]
        ref_out, ref_accepted = rejection_sample_from_random(*inputs)
        # max_num_drafts given (no device reads) or found: the same outputs.
        known = int(inputs[4].max()) if i % 2 else None
        out, num_accepted = rejection_sample_from_random_triton(*inputs, max_num_drafts=known)
        assert torch.equal(out, ref_out)
        assert torch.equal(num_accepted, ref_accepted)
        accepted += int(ref_accepted.sum())
        rejected += int((ref_accepted < inputs[4]).sum())
    assert accepted > 0 and rejected > 0


def test_position_keyed_tokens_sample_the_target():
    """Over many seeds, the token a position's keyed noise picks follows p (chi-square);
    the same (seed, position) always picks the same token, neighbours differ."""
    from verifier.sampling.sampler import position_keyed_tokens, position_seed

    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0, 0.0])
    probs = p.repeat(3, 1)  # one request, K = 2: rows at positions 10, 11, 12
    counts = torch.zeros(3, len(p))
    n = 4000
    for seed in range(n):
        tokens = position_keyed_tokens(probs, [2], [(seed, 10)])
        for row, t in tokens.items():
            counts[row, int(t)] += 1
    assert counts[:, 6:].sum() == 0  # filtered tokens are never picked
    for row in range(3):
        assert chi_square_p_value(counts[row, :6], p[:6] * n) > 1e-3
    # Rows of one request at consecutive positions are not copies of each other.
    assert (counts[0] != counts[1]).any()
    again = position_keyed_tokens(probs, [2], [(77, 10)])
    assert {r: int(t) for r, t in again.items()} == \
        {r: int(t) for r, t in position_keyed_tokens(probs, [2], [(77, 10)]).items()}
    # The position of row 1 at key 10 is row 0's at key 11.
    shifted = position_keyed_tokens(probs, [2], [(77, 11)])
    assert int(shifted[0]) == int(again[1])
    assert len({position_seed(s, t) for s in range(50) for t in range(50)}) == 2500
