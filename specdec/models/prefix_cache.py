"""Automatic prefix caching: the paged KV cache's blocks, refcounted and content-hashed.

A *full* block whose tokens are all committed (prompt tokens, or accepted output:
never a speculative draft, which a verify may still roll back) is registered under
the hash of its contents chained over everything before it:

    hash_0 = H(ROOT, tokens[0 : bs]),  hash_i = H(hash_{i-1}, tokens[i*bs : (i+1)*bs])

so a block matches only where the whole prefix up to and including it is the same
(the same tokens after a different prefix have different keys, and different KV).
H is SHA-256 (vLLM's `--prefix-caching-hash-algo sha256`): a collision would hand a
request another prompt's KV, so a 64-bit hash is not enough.

A new sequence reuses every registered block along its prompt's chain (sharing it:
refcount > 1). A block whose refcount drops to 0 keeps its contents and its hash in
an LRU of evictable blocks, where a later request (the next turn of a conversation,
a preempted sequence coming back) can still find it; it is evicted, oldest first,
only when the pool needs a fresh block and no never-hashed block is free. Shared and
registered blocks are never written: a sequence appends only after its own last
block (hits are whole blocks, so that is a fresh one), and a rollback into a
registered block copies the kept part to a private block first (PagedKVCache).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_HASH = b""  # the parent of a sequence's first block


def root_hash(cache_salt: str = "") -> bytes:
    """The parent of the first block of a sequence with this cache_salt (vLLM's request
    field): ROOT_HASH without one, else a key of the salt, so that sequences of another
    salt (another tenant) never find its blocks, whatever their tokens."""
    if not cache_salt:
        return ROOT_HASH
    return hashlib.sha256(b"cache_salt\0" + cache_salt.encode()).digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its parent's key and its token ids, SHA-256."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative lookups of the prefix cache, in tokens (vLLM's prefix_cache_queries
    and prefix_cache_hits): a sequence admitted with a P-token context (a new prompt,
    or a preempted sequence's prompt and output) queries P tokens and hits the ones
    whose KV it found cached."""

    queries: int = 0
    hits: int = 0

    def record(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Block ids 0..num_blocks-1: refcounts, the hash of each registered block, and
    the free blocks, in two queues: never-hashed ones (taken first) and the LRU of
    evictable hashed ones (least recently released first)."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_of: dict[int, bytes] = {}  # registered block -> its chain hash
        self._block_of: dict[bytes, int] = {}  # chain hash -> the block holding it
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never-hashed free ones and evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable(self) -> list[int]:
        """The evictable blocks, next to be evicted first."""
        return list(self._evictable)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of

    def allocate(self) -> int:
        """A fresh block (refcount 1): a never-hashed free one, else the least recently
        released evictable one, whose hash is forgotten."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.num_evictions += 1
        else:
            raise RuntimeError("no free KV block")  # callers check num_free first
        self.refcount[block] = 1
        return block

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash) if self.enable_caching else None

    def share(self, block: int) -> None:
        """One more sequence uses a registered block (a cache hit)."""
        if self.refcount[block] == 0:
            del self._evictable[block]
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        """A sequence stops using a block. At refcount 0 a registered block becomes
        evictable (contents and hash kept); any other is free at once."""
        if self.refcount[block] <= 0:
            raise RuntimeError(f"block {block} released more often than taken")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> None:
        """Record a full, committed block under its chain hash. When another block
        already holds that hash (two sequences computed the same prefix at the same
        time), the first keeps it and this one stays private."""
        if not self.enable_caching or block_hash in self._block_of:
            return
        if block in self._hash_of:
            raise RuntimeError(f"block {block} is already registered")
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def unregister(self, block: int) -> None:
        """Forget a block's hash (another copy of the same prefix takes it over). The
        sequences using it keep it; unused, it is free at once."""
        del self._block_of[self._hash_of.pop(block)]
        if self.refcount[block] == 0:
            del self._evictable[block]
            self._free.append(block)
