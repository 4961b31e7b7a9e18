"""Suffix decoding: the counted trees, drafts from the request and from past replies,
bounded memory, and the verifier's output with it equal to plain greedy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from drafter import registry
from drafter.suffix import SuffixMethod, SuffixTree
from specdec.pb import common_pb2
from specdec.sampling import SamplingParams
from tests.drafter.through_verifier import decode_with_drafter

GREEDY = SamplingParams(temperature=0.0)


def counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every run in the tree with its count."""
    out = {}
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def brute_counts(sequences: list[list[int]], max_depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for s in sequences:
        for i in range(len(s)):
            for j in range(i + 1, min(i + max_depth, len(s)) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def test_trees_count_every_run_up_to_their_depth():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    grown, added = SuffixTree(5), SuffixTree(5)
    for piece in (seqs[0][:7], seqs[0][7:]):  # extend in two pieces: same as all at once
        grown.extend(piece)
    assert counts(grown) == brute_counts(seqs[:1], 5)
    for s in seqs:
        added.add(s)
    assert counts(added) == brute_counts(seqs, 5)
    assert added.num_nodes == len(counts(added))
    for s in seqs[:3]:
        added.remove(s)
    assert counts(added) == brute_counts(seqs[3:], 5)
    assert added.num_nodes == len(counts(added))
    for s in seqs[3:]:
        added.remove(s)
    assert counts(added) == {} and added.num_nodes == 0


def test_request_context_drafts_what_followed_its_longest_match():
    tree = SuffixTree(24)
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    tree.extend(context)
    node, length = tree.match(context)
    assert length == 3 and set(node.children) == {4}
    # A match of 3 tokens earns at most 3 drafts (max_spec_factor 1): 4 5 9.
    assert tree.draft(context, 8, 1.0, 0.0, 0.1) == ([4, 5, 9], 3.0)
    assert tree.draft(context, 2, 1.0, 0.0, 0.1)[0] == [4, 5]  # K caps it
    assert tree.draft(context, 8, 0.5, 0.0, 0.1)[0] == [4]  # floor(0.5 * 3)
    assert tree.draft(context, 8, 1.0, 2.0, 0.1)[0] == [4, 5, 9, 1, 2]
    assert tree.draft([7, 8], 8, 1.0, 0.0, 0.1) == ([], 0.0)  # no earlier occurrence


def test_drafts_follow_the_most_frequent_continuation_while_likely_enough():
    tree = SuffixTree(8)
    context = [7, 1, 7, 1, 7, 2, 0, 7]
    tree.extend(context)
    # After 7: 1 twice, 2 once; 1 was then followed by 7 both times.
    tokens, score = tree.draft(context, 1, 1.0, 0.0, 0.1)
    assert tokens == [1] and score == pytest.approx(2 / 3)
    assert tree.draft(context, 1, 1.0, 0.0, 0.7) == ([], 0.0)  # 2/3 < 0.7


def test_a_draft_past_the_trees_depth_rematches():
    tree = SuffixTree(3)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    tree.extend(context)
    # Depth 3 holds runs of 3: the walk re-matches [.., 2, 3] -> 4, then [3, 4] -> 5, ...
    assert tree.draft(context, 4, 1.0, 2.0, 0.1)[0] == [3, 4, 5, 6]


def test_past_replies_draft_for_new_requests_and_memory_is_bounded():
    method = SuffixMethod(max_cached_requests=1)
    reply = [50, 51, 52, 53, 54, 55]
    method.start("a", [1, 2, 3], [], GREEDY, 8)
    method.advance("a", 0, 0, reply, 0, None, 0)
    assert method.propose({"a": 4}) == {}  # nothing repeats within the request
    method.free("a")
    assert not method.has("a")
    # A new request whose context ends the way that reply began: the reply continues it.
    method.start("b", [9, 9, 50, 51, 52], [], GREEDY, 8)
    assert method.propose({"b": 8})["b"].token_ids == [53, 54, 55]
    method.free("b")  # prompt only, no reply: nothing is cached
    method.start("c", [8], [60, 61, 62, 63], GREEDY, 8)
    method.free("c")  # evicts the first reply (max_cached_requests=1)
    assert method.cached_replies == ([60, 61, 62, 63],)
    method.start("d", [50, 51, 52], [], GREEDY, 8)
    assert "d" not in method.propose({"d": 8})
    only_c = SuffixTree(method.max_depth)
    only_c.add([60, 61, 62, 63])
    assert method.shared_tree().num_nodes == only_c.num_nodes
    assert method.num_nodes == only_c.num_nodes + method._requests["d"].tree.num_nodes


def test_rollback_counts_the_rest_again():
    method = SuffixMethod()
    method.start("a", [1, 2, 3, 1, 2], [], GREEDY, 8)
    method.advance("a", 0, 0, [3, 4], 0, None, 0)
    method.advance("a", 0, 0, [9], 2, None, 0)  # context: 1 2 3 1 2 9
    fresh = SuffixTree(method.max_depth)
    fresh.extend([1, 2, 3, 1, 2, 9])
    assert counts(method._requests["a"].tree) == counts(fresh)
    with pytest.raises(ValueError, match="num_rollback_tokens"):
        method.advance("a", 0, 0, [], 99, None, 0)


def test_registered_with_its_info_and_checks():
    method = registry.create("suffix", max_num_speculative_tokens=5, vocab_size=100)
    info = method.info()
    assert (info.method, info.vocab_size, info.max_num_speculative_tokens) == (
        common_pb2.SPEC_METHOD_SUFFIX, 100, 5)
    assert not info.needs_hidden_states and not info.returns_probs
    method.start("a", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6], [], GREEDY, 8)
    assert len(method.propose({"a": 8})["a"].token_ids) == 5  # the method's cap
    for kwargs, field in (({"max_depth": 1}, "max_depth"),
                          ({"max_cached_requests": -1}, "max_cached_requests"),
                          ({"max_cached_nodes": -1}, "max_cached_nodes"),
                          ({"max_spec_factor": -1.0}, "max_spec_factor"),
                          ({"min_token_prob": 1.5}, "min_token_prob")):
        with pytest.raises(ValueError, match=field):
            SuffixMethod(**kwargs)


def test_outcome_table_lists_the_drafts_of_every_outcome_a_longer_match_gives():
    """For each accepted count a and every token b of the vocabulary: a listed b's entry
    is what drafting after context + drafts[:a] + [b] gives (the request's tree and a
    past reply's competing), and an unlisted b is one whose match is a token at most,
    or whose drafting gives none."""
    rng = random.Random(3)
    vocab = 5
    for trial in range(300):
        depth = rng.randint(2, 7)
        method = SuffixMethod(max_num_speculative_tokens=4, max_depth=depth,
                              min_token_prob=rng.choice([0.0, 0.3]),
                              max_spec_offset=rng.choice([0.0, 2.0]))
        if rng.random() < 0.5:  # a past reply of the same tenant
            method.start(("past", trial), [0], [rng.randrange(vocab) for _ in range(30)],
                         GREEDY, 4)
            method.free(("past", trial))
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        drafts = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        k = rng.randint(1, 6)
        method.start(trial, context, [], GREEDY, 4)
        before = method.propose({trial: 4}).get(trial)
        table = method.outcome_table(trial, drafts, k)
        assert len(table.groups) == len(drafts) + 1
        assert table.k == min(k, 4) and not table.copy_unlisted
        trees = [method._requests[trial].tree, method.shared_tree()]
        for a, (bonus, lengths, tokens) in enumerate(table.groups):
            assert list(bonus) == sorted(set(bonus.tolist())) and all(lengths >= 1)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
            listed = {int(b): tokens[offsets[i]:offsets[i + 1]].tolist()
                      for i, b in enumerate(bonus)}
            for b in range(vocab):
                extra = drafts[:a] + [b]
                if b in listed:
                    assert listed[b] == method.propose_after(trial, extra, table.k), (
                        context, drafts, a, b)
                else:  # a match of a token at most, or drafts of none
                    after = context + extra
                    assert (all(t is None or t.match(after)[1] <= 1 for t in trees)
                            or not method.propose_after(trial, extra, table.k)), (
                        context, drafts, a, b)
        # The table changed nothing: the same proposal as before it.
        after_table = method.propose({trial: 4}).get(trial)
        assert (after_table and after_table.token_ids) == (before and before.token_ids)


@pytest.mark.parametrize("batch", [1, 8])
def test_with_the_verifier_output_equals_plain_greedy(batch):
    """The verifier drafts from the suffix drafter's tables (an outcome they do not list
    gets no drafts, and waits for none): the output is still plain greedy's, and most
    lookups find their drafts in a table."""
    drafters: list = []
    outputs, expected, last = decode_with_drafter(
        "suffix", lambda vocab: SuffixMethod(vocab_size=vocab), batch, seed=40 + batch,
        drafters=drafters)
    assert outputs == expected
    assert sum(r.spec_decode.num_accepted_tokens for r in last) > 0
    (drafter,) = drafters
    assert drafter.bet_hits > 0.8 * drafter.bet_lookups > 0, drafter


def test_past_replies_draft_only_for_their_own_tenant():
    """A reply learned from tenant a's request drafts for a's next request only: b's
    (and the default tenant's) acceptance cannot tell what a's replies held."""
    method = SuffixMethod()
    method.start("a1", [1, 2, 3], [50, 51, 52, 53, 54, 55], GREEDY, 8)
    method.scope("a1", "tenant-a")
    method.free("a1")
    for key, tenant in (("a2", "tenant-a"), ("b", "tenant-b"), ("default", "")):
        method.start(key, [9, 9, 50, 51, 52], [], GREEDY, 8)
        if tenant:
            method.scope(key, tenant)
    drafts = method.propose({"a2": 8, "b": 8, "default": 8})
    assert drafts["a2"].token_ids == [53, 54, 55]
    assert "b" not in drafts and "default" not in drafts
    assert method.shared_tree("tenant-b") is None and method.shared_tree() is None


def test_past_replies_stay_within_a_node_budget():
    """Replies over max_cached_nodes leave oldest first, whatever their tenant, and a
    tenant whose replies all left holds no tree."""
    reply = list(range(100, 130))
    one = SuffixTree(24)
    one.add(reply)
    method = SuffixMethod(max_cached_nodes=2 * one.num_nodes)
    for i, tenant in enumerate(["x", "y", "z"]):
        key = f"r{i}"
        method.start(key, [1], [t + 100 * i for t in reply], GREEDY, 8)
        method.scope(key, tenant)
        method.free(key)
    assert method.cached_replies == ([t + 100 for t in reply], [t + 200 for t in reply])
    assert method.shared_tree("x") is None
    assert method.num_nodes == 2 * one.num_nodes
