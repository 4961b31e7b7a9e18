"""Pipelined drafting: blocks drafted ahead on a correct bet are used as they
are, wrong bets roll back, and the verifier's output never changes."""

from __future__ import annotations

import pytest

from drafter.draft_model import DraftModelMethod
from drafter.method import DrafterInfo
from specdec.generate import greedy_generate
from specdec.pb import common_pb2
from tests.verifier.test_service import (
    K_MAX,
    VOCAB,
    OracleMethod,
    RandomMethod,
    Stack,
    generate,
    prompts,
    run_concurrently,
    start_msg,
    tiny_target,
)


class _Pipelined:
    def info(self) -> DrafterInfo:
        return DrafterInfo(method=common_pb2.SPEC_METHOD_NGRAM, vocab_size=VOCAB,
                           max_num_speculative_tokens=K_MAX, supports_pipelining=True)


class PipelinedOracle(_Pipelined, OracleMethod):
    pass


class PipelinedRandom(_Pipelined, RandomMethod):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_target()


def run(loop, model, method, batch=4, k=3, max_tokens=40):
    stack = Stack(loop, model, {"d": method})
    try:
        ps = prompts(batch, seed=31)
        results = run_concurrently(lambda m: generate(stack.stub, m),
                                   [(start_msg(p, max_tokens, k=k, drafter="d"),) for p in ps])
        assert [tokens for tokens, _ in results] == greedy_generate(model, ps, max_tokens)
        return stack.drafter_services["d"].servicer.pipeline_stats, results
    finally:
        stack.close()


def test_correct_bets_hit_and_take_drafting_off_the_critical_path(loop, model):
    stats, results = run(loop, model, PipelinedOracle(model))
    # The oracle's bonus guess is the target's own token, so bets fail only
    # where K changed near max_tokens or the sequence ended.
    assert stats.hits > 0 and stats.hit_rate > 0.7
    assert stats.saved_ms > 0
    for _, responses in results:
        assert responses[-1].spec_decode.num_accepted_tokens == responses[-1].spec_decode.num_draft_tokens


def test_wrong_bets_roll_back_and_output_is_unchanged(loop, model):
    stats, _ = run(loop, model, PipelinedRandom(seed=2))
    assert stats.misses > 0 and stats.hits <= stats.misses // 10


def test_draft_model_pipelines_and_releases_its_cache(loop, model):
    method = DraftModelMethod(model=model)  # the target as its own draft: every bet is right
    assert method.info().supports_pipelining
    stats, _ = run(loop, model, method, batch=3, k=4)
    assert stats.hits > 0 and stats.hit_rate > 0.7
    assert method.num_sequences == 0
    assert method.cache.num_free_blocks == method.cache.num_blocks


def test_drafting_ahead_pauses_while_bets_keep_missing():
    from drafter.pipeline import MIN_HIT_RATE, PROBE_EVERY, WINDOW, PipelineStats

    stats = PipelineStats()
    for _ in range(WINDOW):
        assert stats.worth_it()  # no verdict before a full window
        stats.record(False)
    decisions = [stats.worth_it() for _ in range(4 * PROBE_EVERY)]
    # Only the periodic probes draft ahead.
    assert sum(decisions) == 4 and decisions[PROBE_EVERY - 1]
    # Enough hits in the window bring it back for good.
    for _ in range(int(MIN_HIT_RATE * WINDOW) + 1):
        stats.record(True)
    assert all(stats.worth_it() for _ in range(2 * PROBE_EVERY))
    assert stats.hits == int(MIN_HIT_RATE * WINDOW) + 1 and stats.misses == WINDOW
