"""Token-tree verification: the tree helpers, tree attention against each root path run
as a chain, and engine exactness with tree drafts (float64 tiny model)."""

from __future__ import annotations

import random

import pytest
import torch

from drafter.method import Draft
from specdec import tree
from specdec.generate import greedy_generate
from specdec.sampling import SamplingParams
from tests.tiny import tiny_llama
from tests.verifier.test_engine import GREEDY, VOCAB, run
from verifier.engine import Engine, EngineConfig, Proposal, Proposer, Request

# A tree of 7 tokens: two children of the root (0, 3), a chain 0-1-2 with a sibling 4 of
# 1, and 5 under 3, 6 under 5.
PARENTS = [-1, 0, 1, -1, 0, 3, 5]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=0)


def test_tree_helpers():
    assert tree.depths(PARENTS) == [1, 2, 3, 1, 2, 2, 3]
    assert tree.first_child_chain(PARENTS) == [0, 1, 2]
    assert tree.is_chain([-1, 0, 1]) and not tree.is_chain(PARENTS) and tree.is_chain([])
    mask = tree.ancestor_mask(PARENTS)
    # Row 1 + i: the root, token i's ancestors and token i itself.
    want = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 4], 5: [0, 1, 5],
            6: [0, 4, 6], 7: [0, 4, 6, 7]}
    for row, cols in want.items():
        assert mask[row].nonzero().flatten().tolist() == cols, row


@pytest.mark.parametrize("parents,error", [
    ([-1, 1], r"parents\[1\] = 1"), ([0], r"parents\[0\] = 0"), ([-2], r"parents\[0\]"),
    ([-1], "1 entries for 2 draft tokens"),
])
def test_check_parents_names_the_problem(parents, error):
    with pytest.raises(ValueError, match=error):
        tree.check_parents(parents, 2 if error.startswith("1 entries") else len(parents))


def test_a_drafter_cannot_build_a_bad_tree():
    assert Draft([1, 2], parents=[-1, -1]).parents == [-1, -1]
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        Draft([1, 2], parents=[-1, 1])
    with pytest.raises(ValueError, match="one-hot drafts only"):
        Draft([1, 2], probs=torch.full((2, VOCAB), 1 / VOCAB), parents=[-1, -1])


def test_chain_with_siblings_keeps_the_most_probable_paths():
    ids = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    probs = [[0.5, 0.4, 0.1], [0.9, 0.05, 0.05], [0.6, 0.3, 0.1]]
    # Path probabilities: depth 1: .5 .4 .1; depth 2: .45 .025 .025; depth 3: .27 .135 .045.
    tokens, parents = tree.chain_with_siblings(ids, probs, 4)
    assert tokens == [1, 2, 4, 7] and parents == [-1, -1, 0, 2]
    tokens, parents = tree.chain_with_siblings(ids, probs, 6)
    assert tokens == [1, 2, 3, 4, 7, 8] and parents == [-1, -1, -1, 0, 3, 3]
    # A sure head spends the budget on depth: a chain.
    sure = [[0.99, 0.01]] * 3
    tokens, parents = tree.chain_with_siblings([[1, 2], [3, 4], [5, 6]], sure, 3)
    assert tokens == [1, 3, 5] and tree.is_chain(parents)
    # Every budget gives a valid tree whose first-child chain is a prefix of the chain.
    rng = random.Random(0)
    for _ in range(200):
        depth, width = rng.randint(1, 5), rng.randint(1, 4)
        p = [sorted((rng.random() for _ in range(width)), reverse=True) for _ in range(depth)]
        t = [[10 * j + r for r in range(width)] for j in range(depth)]
        budget = rng.randint(1, depth * width)
        tokens, parents = tree.chain_with_siblings(t, p, budget)
        tree.check_parents(parents, len(tokens))
        assert len(tokens) == budget
        chain = [tokens[i] for i in tree.first_child_chain(parents)]
        assert chain == [t[j][0] for j in range(len(chain))]


@torch.inference_mode()
def test_tree_attention_scores_each_node_as_its_root_path(model):
    """Logits of every tree token equal those of a plain forward over the context plus
    its root path, and the kept path's KV, moved into place, is what a chain would
    have written."""
    rng = random.Random(1)
    context = [rng.randrange(VOCAB) for _ in range(13)]
    tokens = [rng.randrange(VOCAB) for _ in PARENTS]

    def path_of(i):
        out = []
        while i >= 0:
            out.append(i)
            i = PARENTS[i]
        return out[::-1]

    cache = model.make_kv_cache(64, 4)
    cache.add(0)
    model(torch.tensor(context[:-1]), cache.plan([(0, len(context) - 1)]), cache)
    meta = cache.plan([(0, 1 + len(tokens))])
    tree.plan_tree_attention(meta, [PARENTS], [len(context) - 1])
    out = model(torch.tensor([context[-1], *tokens]), meta, cache,
                logits_indices=torch.arange(1 + len(tokens)))
    for i in range(len(tokens)):
        path = [tokens[j] for j in path_of(i)]
        ref_cache = model.make_kv_cache(64, 4)
        ref_cache.add(0)
        seq = context + path
        ref = model(torch.tensor(seq), ref_cache.plan([(0, len(seq))]), ref_cache,
                    logits_indices=torch.tensor([len(seq) - 1])).logits
        torch.testing.assert_close(out.logits[1 + i], ref[0], rtol=0, atol=1e-12)

    # Keep the path 3, 5, 6: its KV moves to the slots right after the root.
    n = len(context)
    cache.move(0, [n + j for j in (3, 5, 6)], [n, n + 1, n + 2])
    cache.truncate(0, n + 3)
    chain_cache = model.make_kv_cache(64, 4)
    chain_cache.add(0)
    seq = context + [tokens[j] for j in (3, 5, 6)]
    model(torch.tensor(seq), chain_cache.plan([(0, len(seq))]), chain_cache)
    def slots(c):  # cache slots of positions 0..len(seq) - 1 of sequence 0
        return [c._seqs[0].blocks[p // 4] * 4 + p % 4 for p in range(len(seq))]

    for kv, ref in ((cache.k, chain_cache.k), (cache.v, chain_cache.v)):
        torch.testing.assert_close(kv[:, slots(cache)], ref[:, slots(chain_cache)],
                                   rtol=0, atol=1e-12)


class TreeProposer(Proposer):
    """Random trees around the target's known greedy continuation: the right path hides
    behind wrong siblings (so accepted paths leave the first-child chain and their KV
    must move), with probability `error_rate` a right token turns wrong."""

    def __init__(self, references: dict[int, list[int]], error_rate: float, seed: int):
        self.references = references
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.outcomes: list[tuple[int, int]] = []  # (drafted, accepted)

    def start(self, seq_id, request):
        pass

    def propose(self, wanted, tokens):
        out = {}
        for seq_id, k in wanted.items():
            ref, n = self.references[seq_id], len(tokens[seq_id])
            ids, parents, node = [], [], -1
            depth = 0
            while len(ids) < k:
                right = ref[n + depth] if n + depth < len(ref) else 0
                if self.rng.random() < self.error_rate:
                    right = self.rng.randrange(VOCAB)
                siblings = self.rng.randint(0, min(2, k - len(ids) - 1))
                at = self.rng.randint(0, siblings)  # where the right token sits among them
                first = len(ids)
                for s in range(siblings + 1):
                    ids.append(right if s == at else (right + 1 + s) % VOCAB)
                    parents.append(node)
                node, depth = first + at, depth + 1
            out[seq_id] = Proposal(ids, None, parents)
        return out

    def advance(self, seq_id, outcome):
        if outcome.num_drafted:
            self.outcomes.append((outcome.num_drafted, outcome.num_accepted))

    def free(self, seq_id):
        pass


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("batch", [1, 8])
def test_tree_drafts_keep_greedy_exact(model, batch, k, error_rate):
    rng = random.Random(batch * 10 + k)
    reqs = [Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))], 24,
                    GREEDY, num_speculative_tokens=k if i % 2 == 0 else rng.randint(0, k))
            for i in range(batch)]
    plain = greedy_generate(model, [r.prompt_token_ids for r in reqs], 24)
    refs = {i: r.prompt_token_ids + p for i, (r, p) in enumerate(zip(reqs, plain, strict=True))}
    proposer = TreeProposer(refs, error_rate, seed=k)
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=128, block_size=4,
                                        num_kv_blocks=512, max_num_batched_tokens=96), proposer)
    out = run(engine, reqs)
    assert [out[r.request_id] for r in reqs] == plain
    assert engine.cache.num_free_blocks == 512
    accepted = sum(a for _, a in proposer.outcomes)
    assert accepted > 0
    if error_rate == 0.0:
        # The right path is always in the tree: each round accepts its whole depth
        # unless the sequence ends first.
        assert all(a >= 1 for _, a in proposer.outcomes[:-batch])


def test_sampled_requests_verify_the_first_child_chain(model):
    """A seeded sampled request given trees produces what the same drafts as chains of
    first children produce, and the tree's other tokens are never scored."""
    plain = greedy_generate(model, [[3, 4, 5]], 40)[0]
    refs = {0: [3, 4, 5] + plain}

    class AsChains(TreeProposer):
        def propose(self, wanted, tokens):
            out = super().propose(wanted, tokens)
            return {s: Proposal([p.token_ids[i] for i in tree.first_child_chain(p.parents)])
                    for s, p in out.items()}

    sampling = SamplingParams(temperature=0.8, seed=7)
    outs, drafted = [], []
    for proposer in (TreeProposer(refs, 0.2, seed=5), AsChains(refs, 0.2, seed=5)):
        engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=128),
                        proposer)
        outs.append(run(engine, [Request("s", [3, 4, 5], 40, sampling, num_speculative_tokens=6)]))
        drafted.append([d for d, _ in proposer.outcomes])
    assert outs[0] == outs[1]
    assert drafted[0] == drafted[1]


def test_a_tree_with_probabilities_runs_without_drafts(model):
    class WithProbs(Proposer):
        drafted: list[int] = []

        def start(self, seq_id, request):
            pass

        def propose(self, wanted, tokens):
            return {s: Proposal([1, 2], torch.full((2, VOCAB), 1 / VOCAB), [-1, -1])
                    for s in wanted}

        def advance(self, seq_id, outcome):
            WithProbs.drafted.append(outcome.num_drafted)

        def free(self, seq_id):
            pass

    plain = greedy_generate(model, [[9, 8]], 6)[0]
    engine = Engine(model, EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=64),
                    WithProbs())
    assert run(engine, [Request("p", [9, 8], 6, GREEDY, num_speculative_tokens=2)])["p"] == plain
    # Two-token trees are refused (K = 0); where the scheduler cut K to 1 near the end,
    # the one-token prefix is a chain and carries its q legitimately.
    assert WithProbs.drafted and max(WithProbs.drafted) <= 1
    assert WithProbs.drafted.count(0) >= 3
