"""CPU kernel dispatch of the models' projections.

Every projection of the target (llama.py) and of the EAGLE heads is a `Linear`
run through `linear()`, which picks the kernel by the number of input rows:
up to SMALL_ROWS_MAX rows (decode and verify steps) a small AVX-512 (or AVX2)
kernel that streams the weight once for all rows (small_rows.py); from
PACKED_MIN_ROWS on, oneDNN with the weight reordered once into its blocked
layout; otherwise, or where neither was prepared, F.linear. MKL's plain sgemm
slows down sharply past a few input rows (at SmolLM2-135M size, 5 rows take
~1.7x the time of 1), which makes a verify step of K + 1 tokens cost far more
than a decode step although both read the same weights.

The two kernels round differently, so a token's logits depend on whether its
step had more than SMALL_ROWS_MAX rows, and a near-tie can flip between plain
decoding and speculation (or with the batch). SPECDEC_BATCH_INVARIANT=1 runs
every row count on the small-rows kernel (blocked passes past one pass) and
every prompt chunk on the paged attention kernel (attention.py): a row's bits
then never depend on the step, at a price on big steps (SmolLM2-135M, AMD
EPYC, 2 threads: a plain step of 16 sequences 27.3 -> 32.5 ms, a verify step
of 4 x 5 rows 28.4 -> 34.6 ms, 16 x 5 rows 73 -> 92 ms, prefill +24-35 %; no
oneDNN copy of the weights either).

`pack_linear_weights(module)` prepares a module for both paths: the target
model, and the EAGLE heads in the drafter (a batch's drafting step, or a context
taken in, is more rows than the kernel holds).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models import small_rows

log = logging.getLogger(__name__)

# Rows from which a projection runs on the oneDNN-packed weight. Below, F.linear
# (MKL's GEMV-like path) is faster; from 4 rows on it falls off a cliff (SmolLM2's
# lm_head, 2 threads: 4.4 / 5.6 / 6.4 ms for 1 / 2 / 3 rows, then 9.3 / 12.5 ms for
# 4 / 5, packed 5.0 / 5.2). Whole verify steps at batch 1 (K = 1, 2) cost 1.04x /
# 1.12x a decode step this way, 1.22x / 1.27x with packed weights from 2 rows on.
PACKED_MIN_ROWS = 4
# Rows up to which a projection runs on the small-rows kernel where it is
# available: one pass over the weight; past it the packed weight wins. 16 on Intel
# with AVX-512, 12 elsewhere (small_rows.max_rows() has the measurements).
SMALL_ROWS_MAX = small_rows.max_rows()
# Every row on the small-rows kernel, and every prompt chunk on the paged attention
# kernel: bit-exact rows whatever the step (see the module's docstring). Read at
# each call, so a test may switch it.
ENV_BATCH_INVARIANT = "SPECDEC_BATCH_INVARIANT"
BATCH_INVARIANT = os.environ.get(ENV_BATCH_INVARIANT, "0") == "1"


class Linear(nn.Linear):
    """nn.Linear that may hold a oneDNN-packed copy of its weight and run rows on
    the small-rows kernel (see pack_linear_weights)."""

    packed: torch.Tensor | None = None
    small_rows: bool = False


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x: [M, in] -> [M, out] on the path its Linear was prepared for (getattr: a plain
    nn.Linear takes F.linear)."""
    if getattr(layer, "small_rows", False) and (BATCH_INVARIANT or x.shape[0] <= SMALL_ROWS_MAX):
        return small_rows.linear(x, layer.weight, layer.bias)
    packed = getattr(layer, "packed", None)
    if packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
    return F.linear(x, layer.weight, layer.bias)


def _dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The module's parameter dtype and device (its first parameter's: models here
    keep all weights in one dtype on one device)."""
    p = next(module.parameters())
    return p.dtype, p.device


@torch.no_grad()
def pack_linear_weights(module: nn.Module, enabled: bool = True) -> bool:
    """Run every Linear of `module` through oneDNN on a reordered copy of its weight
    (CPU float32/bfloat16 only; returns whether it did), and in float32 few rows (all
    rows under BATCH_INVARIANT, with no copy) on the small-rows kernel when this
    machine can build it. The copies are not parameters: call again after changing
    weights, dtype or device."""
    dtype, device = _dtype_device(module)
    enabled = (enabled and device.type == "cpu" and torch.backends.mkldnn.is_available()
               and dtype in (torch.float32, torch.bfloat16))
    small = enabled and dtype == torch.float32 and small_rows.available()
    if enabled and dtype == torch.float32 and BATCH_INVARIANT and not small:
        log.warning("%s=1, but the small-rows kernel is off (%s): rows are not "
                    "batch-invariant", ENV_BATCH_INVARIANT, small_rows.unavailable_reason())
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = (torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
                        if enabled and not (small and BATCH_INVARIANT) else None)
            m.small_rows = small
    return enabled
