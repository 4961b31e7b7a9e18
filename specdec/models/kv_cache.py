"""Paged KV cache for many sequences of different lengths.

Keys and values of every layer live in one pool of fixed-size blocks; each
sequence owns a list of blocks (its block table) and a length. Appending a
ragged block of tokens (a prefill chunk, or last token + K drafts) takes
fresh blocks only when the last one is full; rolling back rejected drafts
only shortens the length and returns whole blocks past it to the pool. No
KV data is copied for either; only a token-tree verify copies the few slots of
its accepted path (`move`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


class KVCacheFull(RuntimeError):
    """Not enough free blocks for the requested append; nothing was changed."""


@dataclass(slots=True)
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


@dataclass(slots=True)
class AttentionMetadata:
    """One ragged forward pass: B sequences, T new tokens in all.

    Tokens are laid out sequence after sequence (sequence b owns
    tokens query_start[b] : query_start[b + 1]).
    """

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) to write
    query_start: torch.Tensor  # [B + 1] int64, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int64, sequence lengths including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    query_lens: list[int]  # [B] new tokens per sequence (host copy for shapes)
    max_seq_len: int
    block_size: int
    # Token-tree verify blocks (specdec/tree.py); both None for chains and prefill.
    # rope_positions: [T] int64, the position each token is rotated by where it
    # differs from `positions` (a tree token sits at its root's position + its
    # depth, while its cache slot follows the block's order). tree_masks: per
    # sequence None or its [q, q] bool ancestor mask among its own new tokens.
    rope_positions: torch.Tensor | None = None
    tree_masks: list[torch.Tensor | None] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    def last_token_indices(self) -> torch.Tensor:
        """[B] index of each sequence's last new token (where next-token logits live)."""
        return self.query_start[1:] - 1


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        # [num_layers, num_blocks * block_size, num_kv_heads, head_dim]. Zeroed so
        # that masked-out slots can never inject NaN through 0 * garbage.
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free: deque[int] = deque(range(num_blocks))
        self._seqs: dict[int, _Sequence] = {}

    @classmethod
    def for_model(cls, cfg, num_blocks: int, block_size: int = 16, dtype=torch.float32,
                  device="cpu") -> PagedKVCache:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                   dtype, device)

    # -- bookkeeping ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_free_tokens(self) -> int:
        return len(self._free) * self.block_size

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def length(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def blocks_needed(self, seq_id: int, num_new: int) -> int:
        """Fresh blocks an append of num_new tokens would take."""
        seq = self._seqs.get(seq_id)
        length, owned = (seq.length, len(seq.blocks)) if seq else (0, 0)
        return max(0, -(-(length + num_new) // self.block_size) - owned)

    def can_append(self, seq_id: int, num_new: int) -> bool:
        return self.blocks_needed(seq_id, num_new) <= len(self._free)

    def add(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already in the KV cache")
        self._seqs[seq_id] = _Sequence()

    def truncate(self, seq_id: int, new_length: int) -> None:
        """Roll a sequence back to its first new_length tokens."""
        seq = self._seqs[seq_id]
        if not 0 <= new_length <= seq.length:
            raise ValueError(f"cannot truncate sequence of length {seq.length} to {new_length}")
        seq.length = new_length
        keep = -(-new_length // self.block_size)
        self._free.extend(seq.blocks[keep:])
        del seq.blocks[keep:]

    def move(self, seq_id: int, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of positions src to positions dst of one sequence, in
        every layer (a tree verify keeps its accepted path this way). Reads all of src
        before writing, so the two may overlap."""
        seq = self._seqs[seq_id]
        if len(src) != len(dst) or any(not 0 <= p < seq.length for p in (*src, *dst)):
            raise ValueError(f"move of positions {src} -> {dst} in a sequence of length "
                             f"{seq.length}")
        bs = self.block_size
        slots = [[seq.blocks[p // bs] * bs + p % bs for p in ps] for ps in (src, dst)]
        src_slots, dst_slots = (torch.tensor(s, dtype=torch.int64, device=self.device)
                                for s in slots)
        for cache in (self.k, self.v):  # [layers, slots, Hkv, D]
            cache.index_copy_(1, dst_slots, cache.index_select(1, src_slots))

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(seq.blocks)

    # -- one forward pass ----------------------------------------------------

    def plan(self, appends: list[tuple[int, int]]) -> AttentionMetadata:
        """Reserve room for `appends` = [(seq_id, num_new_tokens), ...] and
        describe the pass. Lengths grow now; the forward writes the slots.
        All-or-nothing: raises KVCacheFull without changing anything."""
        need = sum(self.blocks_needed(s, n) for s, n in appends)
        if need > len(self._free):
            raise KVCacheFull(f"need {need} KV blocks, {len(self._free)} free")
        positions, slots, seq_lens, query_lens, tables = [], [], [], [], []
        bs = self.block_size
        for seq_id, n in appends:
            if n <= 0:
                raise ValueError(f"sequence {seq_id}: append of {n} tokens")
            seq = self._seqs[seq_id]
            start, end = seq.length, seq.length + n
            while len(seq.blocks) * bs < end:
                seq.blocks.append(self._free.popleft())
            seq.length = end
            pos = torch.arange(start, end)
            blocks = torch.tensor(seq.blocks, dtype=torch.int64)
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            query_lens.append(n)
            tables.append(blocks)
        max_blocks = max(t.numel() for t in tables)
        block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int64)
        for i, t in enumerate(tables):
            block_tables[i, : t.numel()] = t
        dev = self.device
        return AttentionMetadata(
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            query_start=torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            query_lens=query_lens,
            max_seq_len=max(seq_lens),
            block_size=bs,
        )

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the tokens at slot_mapping [T]."""
        self.k[layer].index_copy_(0, slot_mapping, k)
        self.v[layer].index_copy_(0, slot_mapping, v)
