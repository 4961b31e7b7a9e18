"""Gateway policies: a request's `speculative` field and admission (method, K or
dynamic K's bound, off)."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.policy.admission import Deployment, decide
from gateway.policy.request import SpeculativeRequest
from specdec.speculation import METHODS, SpeculationPolicy

# --- SpeculativeRequest.from_json ---------------------------------------------------------


@pytest.mark.parametrize("obj", [None, {}, {"method": None, "num_speculative_tokens": None}])
def test_from_json_absent_gives_defaults(obj):
    assert SpeculativeRequest.from_json(obj) == SpeculativeRequest(None, None, False)


def test_from_json_reads_method_k_and_auto():
    assert SpeculativeRequest.from_json({"method": "eagle3", "num_speculative_tokens": 4}) == \
        SpeculativeRequest(method="eagle3", num_speculative_tokens=4, auto=False)
    assert SpeculativeRequest.from_json({"num_speculative_tokens": "auto"}) == \
        SpeculativeRequest(method=None, num_speculative_tokens=None, auto=True)
    assert SpeculativeRequest.from_json({"method": "none", "num_speculative_tokens": 0}) == \
        SpeculativeRequest(method="none", num_speculative_tokens=0)
    for method in METHODS:
        assert SpeculativeRequest.from_json({"method": method}).method == method


def test_from_json_unknown_method_names_field_and_choices():
    with pytest.raises(ValueError) as e:
        SpeculativeRequest.from_json({"method": "foo"})
    msg = str(e.value)
    assert msg.startswith("speculative.method: unknown method 'foo' (expected one of ")
    assert all(m in msg for m in METHODS)


@pytest.mark.parametrize("method", [3, True, ["ngram"], ""])
def test_from_json_bad_method_type_names_field(method):
    with pytest.raises(ValueError, match=r"^speculative\.method: "):
        SpeculativeRequest.from_json({"method": method})


@pytest.mark.parametrize("k", [-1, True, False, 2.0, 2.5, "3", "AUTO", [2], {}])
def test_from_json_bad_k_names_field(k):
    with pytest.raises(ValueError) as e:
        SpeculativeRequest.from_json({"num_speculative_tokens": k})
    assert str(e.value).startswith(
        'speculative.num_speculative_tokens: must be a non-negative integer or "auto"')


def test_from_json_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"^speculative: unknown field.*'metod'.*'k'"):
        SpeculativeRequest.from_json({"metod": "ngram", "k": 2, "method": "ngram"})


@pytest.mark.parametrize("obj", [[], "eagle", 3])
def test_from_json_needs_an_object(obj):
    with pytest.raises(ValueError, match=r"^speculative: must be an object"):
        SpeculativeRequest.from_json(obj)


def test_request_is_checked_on_construction():
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        SpeculativeRequest(num_speculative_tokens=-2)
    with pytest.raises(ValueError, match="speculative.method"):
        SpeculativeRequest(method="medusa")


# --- decide -----------------------------------------------------------------------------


@pytest.fixture
def dep() -> Deployment:
    return Deployment(
        default_method="eagle",
        methods_available=frozenset({"ngram", "eagle"}),
        default_num_speculative_tokens=3,
        max_num_speculative_tokens=5,
    )


def test_decide_method_none_is_off_by_request(dep):
    assert decide(SpeculativeRequest(method="none"), dep) == SpeculationPolicy("none", 0, False, "request")
    assert decide(SpeculativeRequest(method="none", auto=True), dep) == \
        SpeculationPolicy("none", 0, False, "request")


def test_decide_k_zero_is_off_by_request(dep):
    assert decide(SpeculativeRequest(method="ngram", num_speculative_tokens=0), dep) == \
        SpeculationPolicy("none", 0, False, "request")
    assert decide(SpeculativeRequest(num_speculative_tokens=0), dep) == \
        SpeculationPolicy("none", 0, False, "request")


def test_decide_deployment_default_none_is_off(dep):
    plain = Deployment("none", frozenset({"ngram"}), 0, 4)
    assert decide(SpeculativeRequest(), plain).method == "none"
    # ...while a request may still ask for a drafter the deployment offers.
    assert decide(SpeculativeRequest(method="ngram", num_speculative_tokens=2), plain) == \
        SpeculationPolicy("ngram", 2, False, None)


def test_decide_k_over_max_is_an_error_naming_the_field(dep):
    assert decide(SpeculativeRequest(num_speculative_tokens=5), dep).num_speculative_tokens == 5
    with pytest.raises(ValueError, match=r"^speculative\.num_speculative_tokens: 6 .* 5"):
        decide(SpeculativeRequest(num_speculative_tokens=6), dep)
    with pytest.raises(ValueError, match=r"^speculative\.num_speculative_tokens"):
        decide(SpeculativeRequest(num_speculative_tokens=6, auto=True), dep)


def test_decide_unavailable_drafter_runs_plainly(dep):
    for req in (SpeculativeRequest(method="draft_model"),
                SpeculativeRequest(method="eagle3", num_speculative_tokens=2, auto=True)):
        assert decide(req, dep) == SpeculationPolicy(req.method, 0, False, "drafter_unavailable")
    gone = Deployment("eagle", frozenset(), 3, 5)
    assert decide(SpeculativeRequest(), gone) == SpeculationPolicy("eagle", 0, False, "drafter_unavailable")


def test_decide_defaults_and_explicit_values(dep):
    assert decide(SpeculativeRequest(), dep) == SpeculationPolicy("eagle", 3, False, None)
    assert decide(SpeculativeRequest(method="ngram"), dep) == SpeculationPolicy("ngram", 3, False, None)
    assert decide(SpeculativeRequest(num_speculative_tokens=1), dep) == \
        SpeculationPolicy("eagle", 1, False, None)


def test_decide_auto_k_is_an_upper_bound(dep):
    # Bounded by the verifier's maximum (5); within it the verifier chooses each step.
    assert decide(SpeculativeRequest(auto=True), dep) == SpeculationPolicy("eagle", 5, True, None)
    assert decide(SpeculativeRequest(num_speculative_tokens=2, auto=True), dep) == \
        SpeculationPolicy("eagle", 2, True, None)
    assert decide(SpeculativeRequest.from_json({"method": "ngram", "num_speculative_tokens": "auto"}),
                  dep) == SpeculationPolicy("ngram", 5, True, None)


def test_decide_default_auto_k_is_bounded_by_the_default_k(dep):
    auto = dataclasses.replace(dep, default_auto_k=True)
    # No K given: dynamic K within the K the deployment would run statically.
    assert decide(SpeculativeRequest(), auto) == SpeculationPolicy("eagle", 3, True, None)
    assert decide(SpeculativeRequest(method="ngram"), auto) == SpeculationPolicy("ngram", 3, True, None)
    # An explicit K stays static, an explicit "auto" may reach the verifier's maximum.
    assert decide(SpeculativeRequest(num_speculative_tokens=2), auto) == \
        SpeculationPolicy("eagle", 2, False, None)
    assert decide(SpeculativeRequest(auto=True), auto) == SpeculationPolicy("eagle", 5, True, None)
    assert decide(SpeculativeRequest(method="none"), auto) == \
        SpeculationPolicy("none", 0, False, "request")
    with pytest.raises(ValueError, match="default_auto_k"):
        dataclasses.replace(dep, default_auto_k=1)


@pytest.mark.parametrize("kwargs, name", [
    ({"default_method": "medusa"}, "default_method"),
    ({"methods_available": {"eagle", "medusa"}}, "methods_available"),
    ({"default_num_speculative_tokens": -1}, "default_num_speculative_tokens"),
    ({"max_num_speculative_tokens": True}, "max_num_speculative_tokens"),
    ({"default_num_speculative_tokens": 6}, "default_num_speculative_tokens"),
])
def test_deployment_is_checked_on_construction(kwargs, name):
    args = {
        "default_method": "eagle",
        "methods_available": {"eagle"},
        "default_num_speculative_tokens": 3,
        "max_num_speculative_tokens": 5,
    } | kwargs
    with pytest.raises(ValueError, match=name):
        Deployment(**args)


def test_deployment_accepts_any_iterable_of_methods():
    d = Deployment("ngram", ["ngram", "eagle"], 2, 4)
    assert d.methods_available == frozenset({"ngram", "eagle"})


@pytest.mark.parametrize("args, name", [
    (("medusa", 1, False, None), "method"),
    (("ngram", -1, False, None), "num_speculative_tokens"),
    (("ngram", 1, False, "busy"), "disabled_reason"),
    (("none", 2, False, "request"), "method 'none' needs 0"),
    (("ngram", 1, 1, None), "auto_k"),
])
def test_policy_is_checked_on_construction(args, name):
    with pytest.raises(ValueError, match=name):
        SpeculationPolicy(*args)


def test_policy_goes_on_the_wire_and_takes_updates():
    """The one policy type: its proto for the Start of a Generate stream, and the
    verifier's PolicyUpdates, each field checked against the maximum K."""
    from specdec.pb import common_pb2, verifier_pb2

    policy = SpeculationPolicy("eagle3", 3, True, None, "head")
    assert policy.to_proto() == common_pb2.SpeculationPolicy(
        method=common_pb2.SPEC_METHOD_EAGLE3, drafter="head", num_speculative_tokens=3,
        auto_k=True)
    assert policy.effective_k == 3
    update = verifier_pb2.GenerateRequest.PolicyUpdate
    off = policy.updated(update(enabled=False, disabled_reason=common_pb2.DISABLED_REASON_DYNAMIC_K), 8)
    assert (off.disabled_reason, off.effective_k, off.num_speculative_tokens) == ("dynamic_k", 0, 3)
    assert off.updated(update(enabled=True, num_speculative_tokens=5), 8).effective_k == 5
    assert policy.updated(update(auto_k=False), 8).auto_k is False
    with pytest.raises(ValueError, match="policy_update.num_speculative_tokens: 9"):
        policy.updated(update(num_speculative_tokens=9), 8)
    with pytest.raises(ValueError, match="policy_update.enabled"):
        SpeculationPolicy("none", 0, False, "request").updated(update(enabled=True), 8)
    # In the verifier a policy without a drafter serving it runs plain.
    assert SpeculationPolicy("ngram", 4).effective_k == 0
