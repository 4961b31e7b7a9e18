"""Under SPECDEC_BATCH_INVARIANT=1, in float32 on CPU, a token's logits come out
bit for bit the same whatever step computes them: a whole prompt's prefill,
prefill chunks beside other sequences, a prompt's tail after a prefix-cache hit,
one decode row at a time in batches of any size, verify blocks, the path of a
token tree. That is what
keeps greedy speculation's tokens those of plain decoding under any schedule.
By default a row's kernels depend on the step's size, and a near-tie can flip
with the batch."""

from __future__ import annotations

import pytest
import torch

from specdec.models import linear, paged_attention, small_rows
from specdec.models.linear import SMALL_ROWS_MAX, pack_linear_weights
from specdec.tree import plan_tree_attention
from tests.tiny import tiny_llama

VOCAB, PROMPT = 300, 48


@pytest.fixture(scope="module")
def model():
    if not (small_rows.available() and paged_attention.available()):
        pytest.skip(small_rows.unavailable_reason() or paged_attention.unavailable_reason())
    # hidden 256, 4 heads of 64: projections of the shapes the kernels tile in earnest.
    return tiny_llama(VOCAB, seed=7, hidden_size=256, head_dim=64).float()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, schedule: list[list[tuple[int, int]]], prompts: dict[int, list[int]],
        cached: dict[int, list[int]] | None = None) -> dict[int, list[torch.Tensor]]:
    """Run the steps of `schedule`, each a list of (sequence, new tokens) taken from the
    sequence's prompt in order; return every sequence's logits by position. `cached`:
    sequences whose prompt is first run alone so that a prefix-cache hit serves the
    listed sequence's leading blocks."""
    cache = model.make_kv_cache(num_blocks=64, block_size=16, enable_prefix_caching=True)
    done = {s: 0 for s in prompts}
    for s, warm in (cached or {}).items():
        cache.add(s, warm)
        model(torch.tensor(warm), cache.plan([(s, len(warm))]), cache)
        cache.commit(s, warm, len(warm))
        cache.free(s)
    for s in prompts:
        done[s] = cache.add(s, prompts[s])
    out: dict[int, list[torch.Tensor]] = {s: [None] * done[s] for s in prompts}
    for step in schedule:
        ids = [t for s, n in step for t in prompts[s][done[s]:done[s] + n]]
        rows = sum(n for _, n in step)
        logits = model(torch.tensor(ids), cache.plan(step), cache,
                       logits_indices=torch.arange(rows)).logits
        at = 0
        for s, n in step:
            out[s].extend(logits[at:at + n])
            done[s] += n
            at += n
    return out


def schedules(model) -> list[tuple[str, list[torch.Tensor], int]]:
    """Prompt 0's logits by position under several schedules, with the first
    position each one computes: [(name, logits, first)], the whole prefill first."""
    a, b, c = tokens(PROMPT, 1), tokens(30, 2), tokens(PROMPT, 3)
    prompts = {0: a, 1: b, 2: c}
    whole = run(model, [[(0, PROMPT)]], prompts)[0]
    # Chunks beside another prompt's prefill and then its single rows.
    chunked = run(model, [[(0, 7), (1, 30)], [(0, 5)], [(0, 20)], [(0, PROMPT - 32)]],
                  prompts)[0]
    # One row a step beside batches of 1 to 3 rows, then verify-sized blocks beside
    # another sequence's rows: steps on both sides of SMALL_ROWS_MAX rows.
    small, big = SMALL_ROWS_MAX // 2, SMALL_ROWS_MAX + 5
    steps = [[(0, 1)] + ([(2, 1)] if i % 2 else []) for i in range(small)]
    steps += [[(0, 5), (2, big)], [(0, 3)], [(0, 4), (2, 2)]]
    left = PROMPT - small - 12
    steps += [[(0, left), (2, PROMPT - small // 2 - big - 2)]]
    decoded = run(model, steps, prompts)[0]
    # Its first two blocks served by the prefix cache, the tail computed alone.
    hit = run(model, [[(0, PROMPT - 32)]], prompts, cached={3: a})[0]
    return [("whole", whole, 0), ("chunked", chunked, 0), ("decoded", decoded, 0),
            ("after a cache hit", hit, 32), ("in a token tree", tree_path(model, a), 40)]


def tree_path(model, prompt: list[int]) -> list[torch.Tensor | None]:
    """The prompt's logits at positions 40-43 from a token tree verify block, whose
    root is token 40 and whose branch 0 -> 3 -> 4 continues the prompt (the other
    branches are other tokens); positions before 40 are None."""
    cache = model.make_kv_cache(num_blocks=16, block_size=16)
    cache.add(0)
    model(torch.tensor(prompt[:40]), cache.plan([(0, 40)]), cache)
    parents = [-1, -1, 0, 0, 3, 1]
    other = tokens(3, 9)
    block = [prompt[40], prompt[41], other[0], other[1], prompt[42], prompt[43], other[2]]
    meta = cache.plan([(0, len(block))])
    plan_tree_attention(meta, [parents], [40])
    logits = model(torch.tensor(block), meta, cache, logits_indices=torch.arange(len(block))).logits
    return [None] * 40 + [logits[r] for r in (0, 1, 4, 5)] + [None] * (PROMPT - 44)


def test_a_tokens_logits_do_not_depend_on_the_step(model, monkeypatch):
    monkeypatch.setattr(linear, "BATCH_INVARIANT", True)
    assert pack_linear_weights(model)  # for this mode: no oneDNN copies
    (_, whole, _), *others = schedules(model)
    for name, logits, first in others:
        assert len(logits) == PROMPT
        for pos in range(first, PROMPT):
            if logits[pos] is not None:
                assert torch.equal(logits[pos], whole[pos]), f"{name}: position {pos} differs"


def test_by_default_a_big_step_rounds_differently(model, monkeypatch):
    """What the switch is for: with steps past SMALL_ROWS_MAX rows on oneDNN, some
    position comes out with other bits (so the test above can fail)."""
    monkeypatch.setattr(linear, "BATCH_INVARIANT", False)
    assert pack_linear_weights(model)
    (_, whole, _), *others = schedules(model)
    assert any(logits[pos] is not None and not torch.equal(logits[pos], whole[pos])
               for _, logits, first in others for pos in range(first, PROMPT))
