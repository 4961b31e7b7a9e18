"""Prompt lookup: the continuation of the longest, then latest, matching n-gram."""

from __future__ import annotations

import random

import numpy as np
import pytest

from drafter.ngram import NgramMethod, find_continuation
from specdec.pb import common_pb2
from specdec.sampling import SamplingParams
from tests.drafter.through_verifier import decode_with_drafter
from tests.loop_thread import LoopThread
from tests.verifier.test_service import VOCAB, Stack, generate, prompts, start_msg, tiny_target


def _find(tokens: list[int], min_n: int = 1, max_n: int = 4, k: int = 8) -> list[int]:
    return find_continuation(np.array(tokens, dtype=np.int32), min_n, max_n, k).tolist()


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, quadratic: longest n first, then the latest earlier match."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):  # a match must leave a token after it
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_repeated_pattern_proposes_its_continuation():
    assert _find([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2, 3]
    assert _find([5, 6, 7, 5, 6, 7, 5, 6], k=3) == [7, 5, 6]


def test_longest_ngram_wins_over_a_later_shorter_one():
    # Last token 6: its latest earlier occurrence (index 4, followed by 8) matches one
    # token; the one at index 1 also matches the 5 before it, so 7 follows.
    tokens = [5, 6, 7, 9, 6, 8, 5, 6]
    assert _find(tokens, max_n=4) == [7, 9, 6, 8, 5, 6]
    assert _find(tokens, max_n=1) == [8, 5, 6]


def test_latest_match_wins_among_equally_long_ones():
    assert _find([7, 1, 7, 2, 7]) == [2, 7]
    assert _find([3, 4, 10, 3, 4, 11, 3, 4]) == [11, 3, 4]


def test_no_match_proposes_nothing():
    assert _find([1, 2, 3, 4]) == []
    assert _find([9]) == []
    assert _find([]) == []


def test_min_n_rejects_short_matches():
    tokens = [1, 2, 9, 2]  # only the single token 2 recurs
    assert _find(tokens, min_n=1) == [9, 2]
    assert _find(tokens, min_n=2) == []


def test_k_caps_the_draft():
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert _find(tokens, k=2) == [2, 3]
    assert _find(tokens, k=0) == []


def test_matches_the_quadratic_definition_on_random_contexts():
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        assert _find(tokens, min_n, max_n, k) == _reference(tokens, min_n, max_n, k), (
            tokens, min_n, max_n, k)


GREEDY = SamplingParams(temperature=0.0)


def test_outcome_table_lists_the_drafts_of_every_outcome():
    """For each accepted count a and every token b of the vocabulary, the table's entry,
    or for a token it does not list no drafts (min_n >= 2) or a copy of what followed
    b's latest occurrence (min_n 1), is what drafting after context + drafts[:a] + [b]
    gives."""
    rng = random.Random(1)
    vocab = 5
    for trial in range(400):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(max(min_n, 2), 5)
        method = NgramMethod(min_n=min_n, max_n=max_n, max_num_speculative_tokens=4)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        drafts = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        k = rng.randint(1, 6)
        method.start(trial, context, [], GREEDY, 4)
        table = method.outcome_table(trial, drafts, k)
        assert len(table.groups) == len(drafts) + 1
        assert table.k == min(k, 4) and table.copy_unlisted == (min_n == 1)
        for a, (bonus, lengths, tokens) in enumerate(table.groups):
            assert list(bonus) == sorted(set(bonus.tolist())) and all(lengths >= 1)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            listed = {int(b): tokens[offsets[i]:offsets[i + 1]].tolist()
                      for i, b in enumerate(bonus)}
            for b in range(vocab):
                after = context + drafts[:a] + [b]
                # An unlisted b: one-token matches alone (max_n 1), or none.
                unlisted = _find(after, 1, 1, table.k) if table.copy_unlisted else []
                assert listed.get(b, unlisted) == _find(after, min_n, max_n, table.k), (
                    context, drafts, a, b, min_n, max_n, k)
        # The method's state is the context alone: the table changed nothing.
        proposed = method.propose({trial: 4}).get(trial)
        assert (proposed.token_ids if proposed else []) == _find(context, min_n, max_n, 4)
    # Without matches of two tokens there is nothing to list.
    one = NgramMethod(min_n=1, max_n=1)
    one.start(0, [1, 2, 3], [], GREEDY, 4)
    assert one.outcome_table(0, [1], 4) is None


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("min_n", [1, 2])
def test_with_the_verifier_output_equals_plain_greedy(batch, min_n):
    """The verifier drafts from the drafter's tables, which answer every outcome: nearly
    every lookup hits, and the output is still plain greedy's."""
    drafters: list = []
    outputs, expected, last = decode_with_drafter(
        "ngram", lambda vocab: NgramMethod(min_n=min_n, vocab_size=vocab), batch,
        seed=20 + batch, drafters=drafters)
    assert outputs == expected
    assert sum(r.spec_decode.num_draft_tokens for r in last) > 0
    (drafter,) = drafters
    assert drafter.bet_hits > 0.8 * drafter.bet_lookups > 0, drafter


def test_tables_keep_seeded_sampling_exact():
    """Sampled requests drafting from tables (hits and misses both) give, seed for seed,
    the tokens they give without speculation."""
    model = tiny_target()
    loop = LoopThread()
    stack = Stack(loop, model, {"ngram": NgramMethod(vocab_size=VOCAB)})
    try:
        sampled = common_pb2.SamplingParams(temperature=0.8, top_k=20, seed=3)
        for p in [q * 3 for q in prompts(3, seed=5)]:
            plain, _ = generate(stack.stub, start_msg(p, 40, sampling=sampled,
                                                       method=common_pb2.SPEC_METHOD_NONE))
            tokens, responses = generate(stack.stub, start_msg(p, 40, k=4, drafter="ngram",
                                                                sampling=sampled))
            assert tokens == plain
        (drafter,) = stack.load().drafters
        assert drafter.bet_hits > 0.8 * drafter.bet_lookups > 0, drafter
        assert sum(r.step_stats.num_drafted for r in responses) > 0
    finally:
        stack.close()
        loop.close()
