"""Projections on oneDNN-packed weights and the small-rows kernel (the CPU float32
default of load_model; the kernel alone for every row under
SPECDEC_BATCH_INVARIANT) give the logits of plain F.linear."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec.models import linear as linear_module
from specdec.models import load_model, small_rows
from specdec.models.linear import PACKED_MIN_ROWS, Linear, linear, pack_linear_weights

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def step_logits(model, lens: list[int]) -> torch.Tensor:
    """One ragged step over fresh sequences; logits at every position: [sum(lens), V]."""
    cache = model.make_kv_cache(num_blocks=16, block_size=4)
    for s in range(len(lens)):
        cache.add(s)
    meta = cache.plan(list(enumerate(lens)))
    ids = torch.randint(model.config.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    return model(ids, meta, cache, logits_indices=torch.arange(sum(lens))).logits


def is_prepared(model) -> bool:
    """Every Linear with a packed copy, and on the small-rows kernel where this
    machine builds it; under BATCH_INVARIANT (with the kernel) no copy."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    small = small_rows.available()
    copy = not (small and linear_module.BATCH_INVARIANT)
    return all(m.small_rows == small and (m.packed is not None) == copy for m in linears)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")  # Qwen2: a qkv bias too
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).save_pretrained(path)
    return path


@pytest.mark.parametrize("invariant", [False, True])
def test_tiny_packed_matches_plain(tiny_dir, monkeypatch, invariant):
    monkeypatch.setattr(linear_module, "BATCH_INVARIANT", invariant)
    packed = load_model(tiny_dir, dtype="float32")
    plain = load_model(tiny_dir, dtype="float32", pack_linear=False)
    assert is_prepared(packed) and not any(
        isinstance(m, Linear) and (m.packed is not None or m.small_rows)
        for m in plain.modules())
    # 18 rows run on the packed weights (blocked passes of the small-rows kernel
    # under BATCH_INVARIANT); 1, 5 and 9 on the small-rows kernel where this
    # machine has it.
    for lens in ([1, 5, 3], [1], [2, 3], [9, 9]):
        torch.testing.assert_close(step_logits(packed, lens), step_logits(plain, lens),
                                   rtol=0, atol=1e-5)


def test_float64_not_packed(tiny_dir):
    model = load_model(tiny_dir, dtype="float64")
    assert not pack_linear_weights(model)
    assert all(m.packed is None and not m.small_rows
               for m in model.modules() if isinstance(m, Linear))


@pytest.mark.model
def test_smollm2_packed_matches_plain(smollm2_dir):
    packed = load_model(smollm2_dir, dtype="float32")
    assert is_prepared(packed)
    plain = load_model(smollm2_dir, dtype="float32", pack_linear=False)
    # 30 layers of float32 sums in another order: logits of magnitude ~10-20 drift apart
    # by up to ~1e-4 (1.05e-4 seen on an AVX2 machine, where oneDNN tiles differently).
    for lens in ([1, 5, 9], [5], [9, 9]):
        torch.testing.assert_close(step_logits(packed, lens), step_logits(plain, lens),
                                   rtol=2e-5, atol=1e-4)


def test_packed_path_from_min_rows():
    """Fewer rows than PACKED_MIN_ROWS run on F.linear (faster there), more on the
    packed weight: bit-for-bit the output of the path each takes. (At this size the
    two kernels round differently, so each path is told apart.)"""
    torch.manual_seed(0)
    layer = Linear(576, 256, bias=True)
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    gen = torch.Generator().manual_seed(1)
    for rows in (1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, PACKED_MIN_ROWS + 3):
        x = torch.randn(rows, 576, generator=gen)
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        packed = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        assert not torch.equal(plain, packed), f"{rows} rows: the paths agree bit for bit"
        want = packed if rows >= PACKED_MIN_ROWS else plain
        assert torch.equal(linear(x, layer), want), f"{rows} rows took the other path"
