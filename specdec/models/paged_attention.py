"""Attention of decode and verify rows on CPU straight from the paged KV cache,
through a small C kernel (paged_attention.c) built here on first use, as
small_rows.py builds its GEMM.

torch's path gathers every sequence's keys and values out of the cache each
layer and pads the queries to the longest query of the batch, so at batch 11
attention was two thirds of a step, and one sequence verifying 2 rows made the
whole batch pay for 2 (see the C file). The kernel reads each sequence's blocks
in place, for all its rows at once, and its rows are batch-invariant.

Used for float32 on CPU, where the kernel builds (SPECDEC_PAGED_ATTENTION=0
turns it off), for sequences of up to MAX_QUERY new tokens and token trees of up
to MAX_TREE (a tree token reads the keys its path would in decoding, in the same
order); prompts' prefill chunks keep torch's path. With
SPECDEC_BATCH_INVARIANT=1 prefill chunks run here too (at 2000 tokens a prefill
takes about 12 % longer than on torch's flash kernel), so that a prompt's tail
after a prefix-cache hit gets the bits of a full prefill.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from specdec.models import small_rows

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
ENV_SWITCH = "SPECDEC_PAGED_ATTENTION"
# The longest query a sequence may have for the kernel: a verify block of K = 15.
# Longer ones (prefill) are what torch's flash kernel is built for.
MAX_QUERY = 16
# The longest token tree block the kernel takes: a token's ancestors are bits of one
# int64 (larger trees keep torch's path).
MAX_TREE = 63
# The kernel's score accumulator has 8 lanes: the head dimension is a multiple.
LANES = 8

_reason: str | None = None


@functools.cache
def _kernel():
    """The C function, or None (with the reason in _reason, logged once)."""
    global _reason
    lib, _reason = small_rows.load(SOURCE, ENV_SWITCH)
    if lib is None:
        log.warning("paged attention kernel off, CPU attention uses torch's: %s", _reason)
        return None
    fn = lib.paged_attention
    fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 3
                   + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5
                   + [ctypes.c_float, ctypes.c_int])
    fn.restype = None
    return fn


def available() -> bool:
    return _kernel() is not None


def unavailable_reason() -> str | None:
    _kernel()
    return _reason


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
           seqs: torch.Tensor, tree_bits: torch.Tensor | None, max_len: int,
           block_size: int) -> None:
    """Writes out[t] for the query tokens t of the sequences `seqs` (batch indices).
    q, out: [T, H, D] float32, contiguous; k_cache, v_cache: [slots, Hkv, D];
    block_tables: [B, blocks] int64; query_start: [B + 1]; seq_lens: [B] (including
    the step's tokens); tree_bits: None, or [T] int64 with a token tree's token t
    seeing its block's token c where bit c is set (0 outside trees; blocks of at most
    MAX_TREE tokens); max_len: the longest listed sequence. Call only when
    available()."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError(f"the paged attention kernel is off: {_reason}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"paged attention: {name} must be contiguous float32 on CPU")
    for name, t in (("block_tables", block_tables), ("query_start", query_start),
                    ("seq_lens", seq_lens), ("seqs", seqs),
                    ("tree_bits", seqs if tree_bits is None else tree_bits)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"paged attention: {name} must be contiguous int64")
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    if dim % LANES or heads % kv_heads:
        raise ValueError(f"paged attention: head_dim {dim} must be a multiple of {LANES} and "
                         f"heads {heads} of kv_heads {kv_heads}")
    if seqs.numel():
        fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
           block_tables.data_ptr(), block_tables.stride(0), query_start.data_ptr(),
           seq_lens.data_ptr(), seqs.data_ptr(), seqs.numel(),
           None if tree_bits is None else tree_bits.data_ptr(), heads, kv_heads, dim,
           block_size, max_len, dim ** -0.5, torch.get_num_threads())
