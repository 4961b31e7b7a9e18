"""A drafter stream's step packed into messages of bounded size, and read back whole."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.draft_parts import request_parts, response_parts, runs
from specdec.pb import drafter_pb2

Start = drafter_pb2.DraftEntry.Start
Advance = drafter_pb2.DraftEntry.Advance


def entry(seq_id: int, tokens: int, start: bool) -> drafter_pb2.DraftEntry:
    ids = list(range(tokens))
    if start:
        return drafter_pb2.DraftEntry(seq_id=seq_id, start=Start(prompt_token_ids=ids))
    return drafter_pb2.DraftEntry(seq_id=seq_id, round=seq_id + 1,
                                  advance=Advance(new_token_ids=ids, num_speculative_tokens=3))


@given(st.lists(st.integers(0, 300)), st.integers(1, 400))
def test_runs_cover_the_items_in_order_within_the_budget(sizes, budget):
    got = runs(sizes, budget)
    assert [i for run in got for i in range(len(sizes))[run]] == list(range(len(sizes)))
    for run in got:
        within = sum(s + 6 for s in sizes[run]) <= budget
        assert within or run.stop - run.start == 1  # an item over the budget goes alone


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 400), st.booleans()), max_size=30),
       st.integers(64, 2000))
def test_a_request_in_parts_is_the_request(shape, budget):
    request = drafter_pb2.DraftRequest(
        step=7, entries=[entry(i, n, s) for i, (n, s) in enumerate(shape)])
    parts = request_parts(request, budget)
    assert [p.continued for p in parts] == [True] * (len(parts) - 1) + [False]
    assert {p.step for p in parts} == {7}
    assert [e for p in parts for e in p.entries] == list(request.entries)
    for p in parts:
        assert p.ByteSize() <= budget or len(p.entries) == 1
    if request.ByteSize() <= budget:
        assert parts == [request]


@settings(max_examples=50)
@given(st.lists(st.integers(0, 60), max_size=20), st.lists(st.integers(0, 60), max_size=20),
       st.booleans(), st.integers(64, 1000))
def test_an_answer_in_parts_is_the_answer(proposals, bets, followup, budget):
    response = drafter_pb2.DraftResponse(
        step=3, followup=followup, bets_follow=not followup, draft_time_ms=1.5,
        unknown_seq_ids=[90, 91],
        proposals=[drafter_pb2.DraftProposal(seq_id=i, round=1, token_ids=range(n))
                   for i, n in enumerate(proposals)],
        bets=[drafter_pb2.DraftBet(seq_id=i, new_token_ids=[1], token_ids=range(n))
              for i, n in enumerate(bets)])
    parts = response_parts(response, budget)
    assert [p.continued for p in parts] == [True] * (len(parts) - 1) + [False]
    assert all(p.step == 3 and p.followup == followup for p in parts)
    assert [x for p in parts for x in p.proposals] == list(response.proposals)
    assert [x for p in parts for x in p.bets] == list(response.bets)
    # What the answer says besides its items comes with its last message.
    last = parts[-1]
    assert (list(last.unknown_seq_ids), last.bets_follow, last.draft_time_ms) == \
        ([90, 91], not followup, 1.5)
    assert all(not p.unknown_seq_ids and not p.bets_follow for p in parts[:-1])
    for p in parts:
        assert p.ByteSize() <= budget or len(p.proposals) + len(p.bets) == 1
