"""The gateway's choice of method for a request against what its replica reports,
drafters not reached yet included (their method unknown until their first answer)."""

from __future__ import annotations

import pytest

from gateway.core import Gateway, GatewayConfig, InvalidRequest, Unavailable
from gateway.policy.request import SpeculativeRequest
from gateway.replicas import ReplicaPool
from gateway.types import GenerationRequest
from specdec.pb import common_pb2, verifier_pb2


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from specdec.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture
def gateway_and_replica(tokenizer):
    pool = ReplicaPool(["127.0.0.1:1"])  # never connected: the report is set by hand
    replica = pool.replicas[0]
    replica.report = verifier_pb2.LoadReport(max_num_seqs=8, max_num_speculative_tokens=8)
    # ngram answered; eagle3 and "mine" (a name that is no method) not yet.
    for name, method in (("ngram", common_pb2.SPEC_METHOD_NGRAM),
                         ("eagle3", common_pb2.SPEC_METHOD_UNSPECIFIED),
                         ("mine", common_pb2.SPEC_METHOD_UNSPECIFIED)):
        replica.report.drafters.add(name=name, method=method, available=True,
                                    max_num_speculative_tokens=8)
    gateway = Gateway(GatewayConfig(model_name="m", default_method="ngram"), tokenizer, pool)
    return gateway, replica


def _request(**speculative) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=(1, 2), sampling=common_pb2.SamplingParams(),
                             speculative=SpeculativeRequest(**speculative))


def test_a_method_no_drafter_serves_is_a_400_naming_what_runs(gateway_and_replica):
    gateway, replica = gateway_and_replica
    with pytest.raises(InvalidRequest, match="runs no eagle drafter .it runs: eagle3, ngram"):
        gateway._decide(_request(method="eagle"), replica)


def test_a_drafter_not_reached_yet_counts_by_its_name(gateway_and_replica):
    gateway, replica = gateway_and_replica
    assert gateway._decide(_request(method="eagle3"), replica).method == "eagle3"
    assert gateway._decide(_request(drafter="eagle3"), replica).method == "eagle3"
    with pytest.raises(Unavailable, match="'mine' has not been reached yet"):
        gateway._decide(_request(drafter="mine"), replica)
    with pytest.raises(InvalidRequest, match="unknown drafter 'theirs'"):
        gateway._decide(_request(drafter="theirs"), replica)
