"""The wire contract: messages survive serialization and services have the agreed shape."""

from __future__ import annotations

import pytest
import torch

from specdec.pb import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from specdec.tensor_codec import encode_tensor


def _round_trip(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_draft_request_with_start_advance_free_round_trips():
    hidden = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    request = drafter_pb2.DraftRequest(
        step=41,
        entries=[
            drafter_pb2.DraftEntry(
                seq_id=7,
                round=0,
                start=drafter_pb2.DraftEntry.Start(
                    prompt_token_ids=[1, 2, 3],
                    sampling=common_pb2.SamplingParams(temperature=0.7, top_k=20, seed=5),
                    max_num_speculative_tokens=5,
                    output_token_ids=[9],
                    num_speculative_tokens=3,
                ),
            ),
            drafter_pb2.DraftEntry(
                seq_id=8,
                round=12,
                advance=drafter_pb2.DraftEntry.Advance(
                    num_drafted=4,
                    num_accepted=2,
                    new_token_ids=[10, 11, 12],
                    hidden_states=drafter_pb2.HiddenStates(
                        tensor=encode_tensor(hidden), layers=[2, 15], start_position=99
                    ),
                    num_speculative_tokens=0,
                ),
            ),
            drafter_pb2.DraftEntry(seq_id=2**64 - 1, round=3, free=drafter_pb2.DraftEntry.Free()),
        ],
    )

    decoded = _round_trip(request)

    assert decoded == request
    assert decoded.step == 41
    start, advance, free = decoded.entries
    assert [e.WhichOneof("kind") for e in decoded.entries] == ["start", "advance", "free"]
    assert list(start.start.prompt_token_ids) == [1, 2, 3]
    assert start.start.sampling.HasField("seed") and start.start.sampling.seed == 5
    assert start.start.sampling.temperature == pytest.approx(0.7)
    assert not start.start.sampling.HasField("top_p")
    assert list(start.start.output_token_ids) == [9]
    assert (advance.seq_id, advance.round) == (8, 12)
    assert list(advance.advance.new_token_ids) == [10, 11, 12]
    assert advance.advance.num_accepted == 2
    assert advance.advance.num_speculative_tokens == 0
    assert list(advance.advance.hidden_states.layers) == [2, 15]
    assert advance.advance.hidden_states.tensor.data == hidden.numpy().tobytes()
    assert free.seq_id == 2**64 - 1


def test_draft_response_carries_dense_or_sparse_probs():
    response = drafter_pb2.DraftResponse(
        step=41,
        proposals=[
            drafter_pb2.DraftProposal(seq_id=7, round=0, token_ids=[4, 5]),
            drafter_pb2.DraftProposal(
                seq_id=8,
                round=12,
                token_ids=[6],
                probs=drafter_pb2.DraftProbs(
                    sparse=drafter_pb2.SparseProbs(
                        row_lengths=[2], token_ids=[6, 9], probs=[0.75, 0.25]
                    )
                ),
            ),
        ],
        draft_time_ms=1.5,
    )

    greedy, sampled = _round_trip(response).proposals

    assert not greedy.HasField("probs")
    assert sampled.probs.WhichOneof("layout") == "sparse"
    assert list(sampled.probs.sparse.probs) == [0.75, 0.25]


def test_generate_request_oneof_selects_the_last_kind_set():
    request = verifier_pb2.GenerateRequest(
        start=verifier_pb2.GenerateRequest.Start(
            request_id="r1",
            prompt_token_ids=[1, 2],
            speculation=common_pb2.SpeculationPolicy(
                method=common_pb2.SPEC_METHOD_EAGLE3, num_speculative_tokens=4, auto_k=True
            ),
        )
    )
    assert _round_trip(request).WhichOneof("kind") == "start"

    request.policy_update.enabled = False
    request.policy_update.disabled_reason = common_pb2.DISABLED_REASON_QUEUE_SIZE
    decoded = _round_trip(request)
    assert decoded.WhichOneof("kind") == "policy_update"
    assert not decoded.HasField("start")
    assert decoded.policy_update.HasField("enabled") and not decoded.policy_update.enabled
    assert not decoded.policy_update.HasField("num_speculative_tokens")

    cancel = verifier_pb2.GenerateRequest(cancel=verifier_pb2.GenerateRequest.Cancel())
    assert _round_trip(cancel).WhichOneof("kind") == "cancel"


@pytest.mark.parametrize(
    ("module", "service", "methods"),
    [
        (drafter_pb2, "Drafter", {"Draft": (True, True), "Info": (False, False)}),
        (verifier_pb2, "Verifier", {"Generate": (True, True), "Load": (False, False)}),
        (gateway_pb2, "Gateway", {"Generate": (False, True), "Chat": (False, True)}),
    ],
)
def test_service_methods_and_streaming(module, service, methods):
    descriptor = module.DESCRIPTOR.services_by_name[service]
    assert descriptor.full_name == f"specdec.v1.{service}"
    got = {m.name: (m.client_streaming, m.server_streaming) for m in descriptor.methods}
    assert got == methods


@pytest.mark.parametrize(
    ("grpc_module", "service"),
    [
        (drafter_pb2_grpc, "Drafter"),
        (verifier_pb2_grpc, "Verifier"),
        (gateway_pb2_grpc, "Gateway"),
    ],
)
def test_grpc_stubs_exist(grpc_module, service):
    assert hasattr(grpc_module, f"{service}Stub")
    assert hasattr(grpc_module, f"{service}Servicer")
    assert hasattr(grpc_module, f"add_{service}Servicer_to_server")


def test_drafter_method_before_and_after_the_drafter_is_reached():
    from specdec.speculation import drafter_method

    assert drafter_method("eagle3", common_pb2.SPEC_METHOD_UNSPECIFIED) == "eagle3"
    assert drafter_method("mine", common_pb2.SPEC_METHOD_UNSPECIFIED) is None
    assert drafter_method("mine", common_pb2.SPEC_METHOD_NGRAM) == "ngram"
    assert drafter_method("ngram", common_pb2.SPEC_METHOD_NONE) is None
