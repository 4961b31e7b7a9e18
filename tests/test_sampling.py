"""Sampling parameters and filters shared by the verifier and the sampling drafters."""

from __future__ import annotations

import pytest
import torch

from bench.stats import chi_square_p_value
from specdec.pb import common_pb2
from specdec.sampling import (
    CDF_BLOCK,
    SamplingMetadata,
    SamplingParams,
    apply_sampling,
    inverse_cdf,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_params_and_metadata():
    for top_k in (-1, 0, 1, 50):
        SamplingParams(temperature=0.0, top_k=top_k, top_p=1.0, min_p=1.0, seed=0)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=3), SamplingParams(top_k=-1)]
    shared = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="generators"):
        SamplingMetadata.from_params(params, [None, None, None], shared)
    own = params[1].make_generator()
    meta = SamplingMetadata.from_params(params, [None, own, None], shared)
    assert meta.is_greedy.tolist() == [True, False, False]
    assert meta.generators[0] is shared and meta.generators[1] is own
    assert meta.generators[2] is shared
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None  # -1 is off
    assert not meta.all_greedy and SamplingMetadata.make_dummy(4, temperature=0).all_greedy


def test_apply_sampling_filters_in_vllm_order():
    probs = torch.tensor([0.45, 0.35, 0.15, 0.05])
    logits = probs.log()[None]  # [1, 4]
    one = torch.ones(1, dtype=torch.int64)

    def filtered(**kwargs) -> list[float]:
        meta = SamplingMetadata.make_dummy(1, **kwargs)
        return apply_sampling(logits, meta, one)[0].tolist()

    assert filtered() == pytest.approx(probs.tolist())
    assert filtered(temperature=0.5) == pytest.approx((probs**2 / (probs**2).sum()).tolist())
    assert filtered(top_k=2) == pytest.approx([0.5625, 0.4375, 0, 0])
    assert filtered(top_p=0.75) == pytest.approx([0.5625, 0.4375, 0, 0])
    assert filtered(top_p=0.82) == pytest.approx([0.45 / 0.95, 0.35 / 0.95, 0.15 / 0.95, 0])
    assert filtered(min_p=0.2) == pytest.approx([0.45 / 0.95, 0.35 / 0.95, 0.15 / 0.95, 0])
    # min-p comes before top-p: top-p then sees mass renormalised over the first three
    # tokens and keeps two; the other order would keep three.
    assert filtered(min_p=0.2, top_p=0.82) == pytest.approx([0.5625, 0.4375, 0, 0])


def test_params_from_the_wire():
    # Unset temperature and top_p mean 1 (OpenAI's defaults); zero is greedy, not unset.
    assert SamplingParams.from_proto(common_pb2.SamplingParams()) == SamplingParams()
    msg = common_pb2.SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.25, seed=7)
    assert SamplingParams.from_proto(msg) == SamplingParams(0.0, 5, 0.5, 0.25, 7)
    assert SamplingParams.from_proto(msg).is_greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_proto(common_pb2.SamplingParams(top_p=1.5))
    # What a verifier sends its drafters reads back as the same parameters.
    for params in (SamplingParams(), SamplingParams(0.0, 5, 0.5, 0.25, 7),
                   SamplingParams(temperature=0.75, seed=2**64 - 1)):
        assert SamplingParams.from_proto(params.to_proto()) == params
    assert SamplingParams.from_proto(SamplingParams(top_k=-1).to_proto()).top_k == 0


def test_inverse_cdf_follows_the_weights():
    """Weights over three blocks and a padded tail, zeros among them: samples follow
    them (chi-square), a zero weight is never drawn, and the ends of u land on the
    first and the last positive weight."""
    vocab = 2 * CDF_BLOCK + 100
    gen = torch.Generator().manual_seed(5)
    weights = torch.rand(vocab, generator=gen) ** 4  # unnormalised, uneven
    weights[CDF_BLOCK: 2 * CDF_BLOCK] = 0  # a whole block without mass
    weights[::7] = 0
    weights[vocab - 3:] = 0  # the last positive weight is not the last token
    n = 200_000
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    tokens = inverse_cdf(weights.expand(n, vocab), u)
    observed = torch.bincount(tokens, minlength=vocab)[None]  # [1, V]
    expected = (weights.double() / weights.double().sum() * n)[None]  # [1, V]
    assert observed[expected == 0].sum() == 0
    assert chi_square_p_value(observed, expected) > 1e-3
    ends = inverse_cdf(weights.expand(2, vocab),
                       torch.tensor([0.0, 1 - 2.0 ** -53], dtype=torch.float64))
    positive = weights.nonzero()[:, 0]
    assert ends.tolist() == [int(positive[0]), int(positive[-1])]
