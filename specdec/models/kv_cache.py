"""Paged KV cache for many sequences of different lengths.

Keys and values of every layer live in one pool of fixed-size blocks; each
sequence owns a list of blocks (its block table) and a length. Appending a
ragged block of tokens (a prefill chunk, or last token + K drafts) takes
fresh blocks only when the last one is full; rolling back rejected drafts
only shortens the length and returns whole blocks past it to the pool. No
KV data is copied for either; only a token-tree verify copies the few slots of
its accepted path (`move`).

With prefix caching (specdec/models/prefix_cache.py) a sequence may start with
blocks another sequence computed: `add` reuses the cached full blocks of its
prompt, `commit` registers its own full blocks once their tokens are committed,
and released blocks stay findable until evicted. Shared blocks are read-only:
appends, rollbacks and tree moves only ever write the sequence's own blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specdec.models.prefix_cache import BlockPool, chain_hash, root_hash


class KVCacheFull(RuntimeError):
    """Not enough free blocks for the requested append; nothing was changed."""


@dataclass(slots=True)
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    # Chain hashes of the leading full blocks whose tokens are committed (registered
    # in the pool, or computed twice and kept private): blocks[:len(hashes)] are never
    # written again.
    hashes: list[bytes] = field(default_factory=list)
    # Its drafter's features (the target's hidden-state rows) are kept for every one of
    # its positions from 0 on, so the blocks it registers carry them for later hits.
    features_ok: bool = False
    root: bytes = b""  # its first block's parent: prefix_cache.root_hash(its cache_salt)


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

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """The same step with its tensors on `device` (a metadata planned on the host
        for a CUDA graph's staging, moved for an eager step instead)."""
        if self.positions.device == torch.device(device):
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, positions=move(self.positions), slot_mapping=move(self.slot_mapping),
                       query_start=move(self.query_start), seq_lens=move(self.seq_lens),
                       block_tables=move(self.block_tables),
                       rope_positions=move(self.rope_positions))


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
        enable_prefix_caching: bool = False,
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
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._seqs: dict[int, _Sequence] = {}
        # Features beside the KV (keep_features): [num_blocks * block_size, L * hidden],
        # the rows of feature_layers of every slot, so that a sequence whose drafter
        # reads hidden states (EAGLE) can take cached blocks too and still hand its
        # drafter the rows of the positions it did not compute.
        self.features: torch.Tensor | None = None
        self.feature_layers: tuple[int, ...] = ()
        self._block_features = bytearray(num_blocks)  # registered block -> rows kept

    @classmethod
    def for_model(cls, cfg, num_blocks: int, block_size: int = 16, dtype=torch.float32,
                  device="cpu", enable_prefix_caching: bool = False) -> PagedKVCache:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                   dtype, device, enable_prefix_caching)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    # -- bookkeeping ---------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an append can take, evictable cached ones included."""
        return self.pool.num_free

    @property
    def num_free_tokens(self) -> int:
        return self.pool.num_free * self.block_size

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

    def blocks(self, seq_id: int) -> list[int]:
        """The sequence's block table (a copy)."""
        return list(self._seqs[seq_id].blocks)

    def can_append(self, seq_id: int, num_new: int) -> bool:
        return self.blocks_needed(seq_id, num_new) <= self.pool.num_free

    def add(self, seq_id: int, tokens: Sequence[int] = (), features: bool = False,
            cache_salt: str = "") -> int:
        """Start a sequence whose first tokens are `tokens`; with prefix caching, it
        takes over the KV of their longest cached chain of full blocks, but never of
        the last token: one must run through the model to give logits to sample from.
        features: the sequence keeps its features (keep_features) and takes only blocks
        that carry them. cache_salt: it shares blocks only with sequences of the same
        salt. Returns the number of leading tokens whose KV is there (a multiple of the
        block size; 0 without prefix caching)."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already in the KV cache")
        if features and self.features is None:
            raise ValueError("features: keep_features was not called")
        seq = self._seqs[seq_id] = _Sequence(features_ok=features, root=root_hash(cache_salt))
        if not self.pool.enable_caching:
            return 0
        bs = self.block_size
        parent = seq.root
        for i in range((len(tokens) - 1) // bs):
            h = chain_hash(parent, tokens[i * bs: (i + 1) * bs])
            block = self.pool.lookup(h)
            if block is None or (features and not self._block_features[block]):
                break
            self.pool.share(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
            parent = h
        seq.length = len(seq.blocks) * bs
        return seq.length

    def commit(self, seq_id: int, tokens: Sequence[int], num_committed: int) -> None:
        """tokens[:num_committed] are final (prompt or accepted output) and their KV is
        in the cache: register every full block among them for reuse. Call only with
        committed tokens, never drafts a verify may still reject."""
        seq = self._seqs[seq_id]
        if not self.pool.enable_caching:
            return
        if num_committed > seq.length:
            raise ValueError(f"commit of {num_committed} tokens in a sequence of length "
                             f"{seq.length}")
        bs = self.block_size
        for i in range(len(seq.hashes), num_committed // bs):
            h = chain_hash(seq.hashes[-1] if seq.hashes else seq.root,
                           tokens[i * bs: (i + 1) * bs])
            seq.hashes.append(h)
            held = self.pool.lookup(h)
            if (held is not None and held != seq.blocks[i] and seq.features_ok
                    and not self._block_features[held]):
                # A copy that carries features serves every sequence; the one without
                # serves only those whose drafter reads none.
                self.pool.unregister(held)
            self.pool.register(seq.blocks[i], h)
            if self.pool.lookup(h) == seq.blocks[i]:
                self._block_features[seq.blocks[i]] = seq.features_ok

    def truncate(self, seq_id: int, new_length: int) -> None:
        """Roll a sequence back to its first new_length tokens. Blocks past it return to
        the pool (a shared or cached one only loses this sequence's reference). A cut
        inside a committed block, which others may share or find, first moves the kept
        part to a private copy, so that the appends that follow never write into it."""
        seq = self._seqs[seq_id]
        if not 0 <= new_length <= seq.length:
            raise ValueError(f"cannot truncate sequence of length {seq.length} to {new_length}")
        bs = self.block_size
        keep = -(-new_length // bs)
        cut = new_length // bs  # index of the block the cut lands in, if not on a boundary
        if (cut < len(seq.hashes) and new_length % bs
                and (self.pool.refcount[seq.blocks[cut]] > 1
                     or self.pool.is_registered(seq.blocks[cut]))):
            if not self.pool.num_free:
                raise KVCacheFull("no free KV block for a copy of a committed block")
            private = self.pool.allocate()
            src = torch.arange(seq.blocks[cut] * bs, seq.blocks[cut] * bs + new_length % bs,
                               device=self.device)
            for cache in (self.k, self.v):  # [layers, slots, Hkv, D]
                cache[:, private * bs: private * bs + src.numel()] = cache[:, src]
            if self.features is not None:  # [slots, F]
                self.features[private * bs: private * bs + src.numel()] = self.features[src]
            self.pool.release(seq.blocks[cut])
            seq.blocks[cut] = private
        del seq.hashes[cut:]
        seq.length = new_length
        for block in reversed(seq.blocks[keep:]):
            self.pool.release(block)
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
        if any(p // bs < len(seq.hashes) for p in dst):
            raise ValueError(f"move into committed positions {dst}: its blocks may be shared")
        slots = [[seq.blocks[p // bs] * bs + p % bs for p in ps] for ps in (src, dst)]
        src_slots, dst_slots = (torch.tensor(s, dtype=torch.int64, device=self.device)
                                for s in slots)
        for cache in (self.k, self.v):  # [layers, slots, Hkv, D]
            cache.index_copy_(1, dst_slots, cache.index_select(1, src_slots))
        if self.features is not None:  # [slots, F]
            self.features.index_copy_(0, dst_slots, self.features.index_select(0, src_slots))

    def free(self, seq_id: int) -> None:
        """Drop a sequence. Its blocks are released last first, so that of its cached
        blocks the tail of the prefix is evicted before the head (a chain is only
        found from its head)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for block in reversed(seq.blocks):
                self.pool.release(block)

    # -- features (hidden-state rows) beside the KV ---------------------------

    def keep_features(self, layers: tuple[int, ...], hidden_size: int) -> bool:
        """Keep the hidden-state rows of `layers` (hidden_size wide each) beside the KV,
        allocated on the first call. False when other layers are kept already (one
        set per cache: a deployment's EAGLE drafters read the same ones)."""
        layers = tuple(layers)
        if self.features is None:
            self.features = torch.zeros(self.num_blocks * self.block_size,
                                        len(layers) * hidden_size, dtype=self.k.dtype,
                                        device=self.device)
            self.feature_layers = layers
        return layers == self.feature_layers

    def wants_features(self, seq_id: int) -> bool:
        return self._seqs[seq_id].features_ok

    def write_features(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows: [M, L * hidden], the features of the positions at slots [M]."""
        self.features.index_copy_(0, slots, rows)

    def lose_features(self, seq_id: int) -> None:
        """Some of the sequence's positions were computed without their features kept:
        the blocks it registers from now on carry none."""
        self._seqs[seq_id].features_ok = False

    def read_features(self, seq_id: int, num: int, start: int = 0) -> torch.Tensor:
        """[num, L * hidden]: the features of the sequence's positions start..start+num-1."""
        seq, bs = self._seqs[seq_id], self.block_size
        if start + num > seq.length:
            raise ValueError(f"features of positions {start}..{start + num - 1} in a sequence "
                             f"of length {seq.length}")
        blocks = torch.tensor(seq.blocks, dtype=torch.int64)
        pos = torch.arange(start, start + num)
        return self.features.index_select(0, (blocks[pos // bs] * bs + pos % bs).to(self.device))

    # -- one forward pass ----------------------------------------------------

    def plan(self, appends: list[tuple[int, int]],
             device: torch.device | str | None = None) -> AttentionMetadata:
        """Reserve room for `appends` = [(seq_id, num_new_tokens), ...] and
        describe the pass. Lengths grow now; the forward writes the slots.
        All-or-nothing: raises KVCacheFull without changing anything.
        device: where the metadata's tensors go (default: the cache's); "cpu" for a
        step a CUDA graph will take, which stages them in one copy (cuda_graphs.py)."""
        need = sum(self.blocks_needed(s, n) for s, n in appends)
        if need > self.pool.num_free:
            raise KVCacheFull(f"need {need} KV blocks, {self.pool.num_free} free")
        positions, slots, seq_lens, query_lens, tables = [], [], [], [], []
        bs = self.block_size
        for seq_id, n in appends:
            if n <= 0:
                raise ValueError(f"sequence {seq_id}: append of {n} tokens")
            seq = self._seqs[seq_id]
            start, end = seq.length, seq.length + n
            while len(seq.blocks) * bs < end:
                seq.blocks.append(self.pool.allocate())
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
        dev = self.device if device is None else device
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
