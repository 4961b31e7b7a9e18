"""Attention over the paged KV cache, behind a small interface.

A backend turns the step's AttentionMetadata into whatever per-step state it
needs once (`prepare`), then every layer calls `forward` with that state.
Other backends (FlashAttention/FlashInfer on GPU) join by registering a
class under a name. `prepare_static` is the variant a CUDA graph can capture:
no host reads, shapes fixed by the metadata's tensors alone.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models import linear, paged_attention
from specdec.models.kv_cache import AttentionMetadata


class AttentionBackend(ABC):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        # Decode and verify steps through the Triton paged kernel (fused/paged_attention.py;
        # the model's FusedOps.attention sets it).
        self.triton_paged = False

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> object:
        """Per-step state shared by all layers."""

    def prepare_static(self, meta: AttentionMetadata) -> object:
        """Like `prepare`, for a step in which every sequence has the same query
        length, with keys gathered over every column of meta.block_tables and
        lengths read from positions only: shapes depend on tensor shapes alone
        and nothing syncs with the device, so the step can be captured in a
        CUDA graph (see specdec/models/cuda_graphs.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no static-shape path")

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                state: object) -> torch.Tensor:
        """q: [T, H, D]; k_cache, v_cache: [slots, Hkv, D] of one layer, with this
        step's keys and values already written. Returns [T, H, D]."""


@dataclass(slots=True)
class _SdpaState:
    kv_slots: torch.Tensor  # [B, L] cache slot of each key position (L = max blocks * block_size)
    # [T] index of each token in the padded [B * Qmax] query layout; None when every
    # sequence has Qmax tokens (the flat layout already is the padded one).
    pad_index: torch.Tensor | None
    mask: torch.Tensor | None  # [B, 1, Qmax, L] bool, True = attend; None = attend to all
    batch: int
    max_query: int


@dataclass(slots=True)
class _TritonPagedState:
    """A step whose sequences all feed at most TRITON_MAX_QUERY rows, none a token tree:
    the Triton kernel reads the metadata's tensors as they are."""

    meta: AttentionMetadata
    max_query: int  # host bound on any sequence's rows (the kernel's tile height)


# Rows per sequence up to which the Triton paged kernel takes a step (verify blocks of
# K + 1 <= 16); a step with a longer one (a prefill chunk) runs on torch's path whole.
TRITON_MAX_QUERY = 16


@dataclass(slots=True)
class _SplitState:
    """A CPU step split between the paged kernel (decode rows, verify blocks and token
    trees) and torch's path (the rest: prefill chunks, trees of over 63 tokens)."""

    meta: AttentionMetadata
    kernel_seqs: torch.Tensor  # [S] int64: batch indices of the kernel's sequences
    max_len: int  # the longest of them
    rest: _SdpaState | None  # torch's path for the other sequences
    rest_rows: torch.Tensor | None  # [T'] their tokens' indices in the step
    whole: _SdpaState | None = None  # torch's path for all, built for a dtype the kernel lacks
    # [T] int64: a tree token's ancestors in its block as bits, 0 elsewhere; None: no tree
    tree_bits: torch.Tensor | None = None


class SdpaBackend(AttentionBackend):
    """torch scaled_dot_product_attention on a padded view of the ragged batch.

    Keys are gathered per sequence from its blocks ([B, L, Hkv, D]); queries are
    scattered into [B, Qmax]. The mask encodes causality at each query's true
    position, the sequence's length and the sliding window, so padding never
    leaks into real outputs.

    On CPU in float32, sequences of up to paged_attention.MAX_QUERY new tokens
    (decode and verify) and token trees of up to paged_attention.MAX_TREE go to the
    paged kernel instead, which reads the cache in place and does not pad
    (paged_attention.py); with
    SPECDEC_BATCH_INVARIANT=1 (linear.BATCH_INVARIANT) prefill chunks too, so a
    row's bits never depend on how many rows its sequence brings to the step.
    """

    def prepare(self, meta: AttentionMetadata) -> _SdpaState | _SplitState | _TritonPagedState:
        if self._triton_takes(meta):
            return _TritonPagedState(meta, max(meta.query_lens))
        if (meta.positions.device.type == "cpu" and self.sliding_window is None
                and self.head_dim % paged_attention.LANES == 0 and paged_attention.available()):
            trees = meta.tree_masks or [None] * meta.batch_size
            longest = math.inf if linear.BATCH_INVARIANT else paged_attention.MAX_QUERY
            short = [b for b, (n, tree) in enumerate(zip(meta.query_lens, trees, strict=True))
                     if n <= (longest if tree is None else paged_attention.MAX_TREE)]
            if short:
                return self._split(meta, short)
        return self._prepare(meta)

    def _split(self, meta: AttentionMetadata, short: list[int]) -> _SplitState:
        seq_lens = meta.seq_lens.tolist()
        state = _SplitState(meta, torch.tensor(short, dtype=torch.int64),
                            max(seq_lens[b] for b in short), None, None)
        rest = sorted(set(range(meta.batch_size)) - set(short))
        if rest:
            starts = meta.query_start.tolist()
            rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in rest])
            lens = [meta.query_lens[b] for b in rest]
            index = torch.tensor(rest, dtype=torch.int64)
            sub = AttentionMetadata(
                positions=meta.positions[rows], slot_mapping=meta.slot_mapping[rows],
                query_start=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64),
                seq_lens=meta.seq_lens[index], block_tables=meta.block_tables[index],
                query_lens=lens, max_seq_len=max(seq_lens[b] for b in rest),
                block_size=meta.block_size,
                tree_masks=None if meta.tree_masks is None else [meta.tree_masks[b] for b in rest])
            state.rest, state.rest_rows = self._prepare(sub), rows
        if meta.tree_masks is not None and any(meta.tree_masks[b] is not None for b in short):
            state.tree_bits = torch.zeros(meta.num_tokens, dtype=torch.int64)
            starts = meta.query_start.tolist()
            for b in short:
                if (tree := meta.tree_masks[b]) is not None:
                    # Row r's mask [q] bool -> sum of 2^c over the columns it sees.
                    powers = torch.tensor([1 << c for c in range(tree.shape[1])])
                    state.tree_bits[starts[b]:starts[b + 1]] = (tree.cpu().long() * powers).sum(1)
        return state

    def _prepare(self, meta: AttentionMetadata) -> _SdpaState:
        dev = meta.positions.device
        bs = meta.block_size
        batch, max_q = meta.batch_size, max(meta.query_lens)
        num_blocks = -(-meta.max_seq_len // bs)
        tables = meta.block_tables[:, :num_blocks]  # [B, nb]
        kv_slots = (tables[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(batch, -1)
        q_lens = meta.query_start[1:] - meta.query_start[:-1]  # [B]
        seq_of_token = torch.repeat_interleave(torch.arange(batch, device=dev), q_lens)  # [T]
        offset_in_seq = torch.arange(meta.num_tokens, device=dev) - meta.query_start[seq_of_token]
        pad_index = seq_of_token * max_q + offset_in_seq
        # Position of every padded query; padding rows look at key 0 only, so
        # their softmax stays finite (their outputs are dropped).
        q_pos = torch.zeros(batch * max_q, dtype=torch.int64, device=dev)
        q_pos[pad_index] = meta.positions
        q_pos = q_pos.view(batch, max_q, 1)
        k_pos = torch.arange(kv_slots.shape[1], device=dev).view(1, 1, -1)
        single_decode = max_q == 1 and self.sliding_window is None and batch == 1
        if single_decode:
            # One query at the end of one sequence: every gathered key up to
            # the length is visible; trim the gather instead of masking.
            kv_slots = kv_slots[:, : meta.max_seq_len]
            mask = None
        else:
            mask = self._mask(q_pos, k_pos)
        if meta.tree_masks is not None:
            # A tree block's tokens see the context causally (by slot order) and,
            # within the block, only their own ancestors: its keys are the last
            # q of the sequence's seq_len.
            for b, (tree, end) in enumerate(zip(meta.tree_masks, meta.seq_lens.tolist(),
                                                strict=True)):
                if tree is not None:
                    q = tree.shape[0]
                    mask[b, 0, :q, end - q: end] = tree.to(mask.device)
        return _SdpaState(kv_slots, pad_index, mask, batch, max_q)

    def _triton_takes(self, meta: AttentionMetadata) -> bool:
        return (self.triton_paged and meta.tree_masks is None
                and max(meta.query_lens) <= TRITON_MAX_QUERY)

    def prepare_static(self, meta: AttentionMetadata) -> _SdpaState | _TritonPagedState:
        bs, batch, q = meta.block_size, meta.batch_size, meta.query_lens[0]
        assert meta.num_tokens == batch * q, "prepare_static wants one query length for all"
        assert meta.tree_masks is None, "token trees run eagerly"
        if self._triton_takes(meta):
            return _TritonPagedState(meta, q)
        dev = meta.positions.device
        # [B, nb * bs]: every column, also past the sequence's own blocks (masked).
        kv_slots = (meta.block_tables[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(batch, -1)
        k_pos = torch.arange(kv_slots.shape[1], device=dev).view(1, 1, -1)
        # Keys past a sequence's length lie after its last query: causality masks them.
        return _SdpaState(kv_slots, None, self._mask(meta.positions.view(batch, q, 1), k_pos),
                          batch, q)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos [B, Qmax, 1], k_pos [1, 1, L] -> [B, 1, Qmax, L] bool, True = attend."""
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask = mask & (k_pos > q_pos - self.sliding_window)
        return mask[:, None]

    def forward(self, q, k_cache, v_cache,
                state: _SdpaState | _SplitState | _TritonPagedState) -> torch.Tensor:
        if isinstance(state, _TritonPagedState):
            from specdec.models.fused import paged_attention as triton_paged

            meta = state.meta
            return triton_paged.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.seq_lens,
                meta.positions, meta.block_size, state.max_query,
                sliding_window=self.sliding_window)
        if not isinstance(state, _SplitState):
            return self._sdpa(q, k_cache, v_cache, state)
        if q.dtype != torch.float32 or k_cache.dtype != torch.float32:
            if state.whole is None:  # the kernel is float32 only
                state.whole = self._prepare(state.meta)
            return self._sdpa(q, k_cache, v_cache, state.whole)
        q = q.contiguous()
        out = torch.empty_like(q)
        meta = state.meta
        paged_attention.attend(q, k_cache, v_cache, out, meta.block_tables, meta.query_start,
                               meta.seq_lens, state.kernel_seqs, state.tree_bits, state.max_len,
                               meta.block_size)
        if state.rest is not None:
            out.index_copy_(0, state.rest_rows,
                            self._sdpa(q.index_select(0, state.rest_rows), k_cache, v_cache,
                                       state.rest))
        return out

    def _sdpa(self, q, k_cache, v_cache, state: _SdpaState) -> torch.Tensor:
        b, max_q = state.batch, state.max_query
        num_tokens, heads, dim = q.shape
        flat = state.kv_slots.reshape(-1)
        kv_shape = (*state.kv_slots.shape, *k_cache.shape[1:])  # [B, L, Hkv, D]
        k = k_cache.index_select(0, flat).view(kv_shape).transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache.index_select(0, flat).view(kv_shape).transpose(1, 2)
        if b * max_q == num_tokens:
            qp = q.view(b, max_q, heads, dim)
        else:
            qp = q.new_zeros(b * max_q, heads, dim).index_copy_(0, state.pad_index, q)
            qp = qp.view(b, max_q, heads, dim)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k, v, attn_mask=state.mask,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, Qmax, D]
        out = out.transpose(1, 2).reshape(b * max_q, heads, dim)
        if b * max_q == num_tokens:
            return out
        return out.index_select(0, state.pad_index)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"sdpa": SdpaBackend}
