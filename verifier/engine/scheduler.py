"""Which sequences run in the next step, with how many tokens each.

Running sequences come first (in admission order), then waiting ones are
admitted while the KV cache and the token budget allow: the lowest `priority`
value first (vLLM's meaning), in arrival order among equals. A decoding sequence
asks for 1 + K tokens; when the cache is short it drops to K = 0, and if
even one token does not fit, the most recently admitted sequence is
preempted (its KV freed, to be recomputed later), of those with the highest
priority value. Requests wait, never
fail, when the cache is full.

With prefix caching, an admitted sequence starts after the KV the cache already
holds for its leading full blocks (a shared system prompt, an earlier turn of its
conversation, its own KV from before a preemption) and prefills only the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from specdec.models import PagedKVCache
from specdec.models.prefix_cache import PrefixCacheStats
from verifier.engine.sequence import Sequence, Status


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    num_tokens: int  # prefill: chunk length; decode: 1 + K (upper bound; drafts may be fewer)
    is_prefill: bool
    # Why the engine runs it without drafts this step although its request asks for
    # some ("queue_size", "dynamic_k"); None: it does not, or drafts are asked for.
    plain_reason: str | None = None

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.is_prefill else self.num_tokens - 1


class Scheduler:
    def __init__(self, cache: PagedKVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq.seq_id)

    def wanted_num_speculative_tokens(self, seq: Sequence, max_num_speculative_tokens: int) -> int:
        """K for a decoding sequence: never draft past max_tokens or the model length."""
        room = min(seq.request.max_tokens - seq.num_output, self.max_model_len - len(seq.tokens))
        k = seq.request.num_speculative_tokens
        return max(0, min(k, max_num_speculative_tokens, room - 1))

    def schedule(self, max_num_speculative_tokens: int,
                 only: Collection[str] | None = None) -> list[Scheduled]:
        """only: schedule just these running requests (by request id) and admit none,
        for a step retried in part (Engine.step)."""
        budget = self.max_num_batched_tokens
        batch: list[Scheduled] = []
        reserved = 0  # KV blocks promised to this batch; the cache allocates them at plan time
        for seq in list(self.running):
            if (seq.status is not Status.RUNNING or budget <= 0
                    or (only is not None and seq.request.request_id not in only)):
                continue
            if seq.in_prefill:
                n = min(len(seq.tokens) - seq.num_computed, budget)
                item = Scheduled(seq, n, True)
            else:
                k = self.wanted_num_speculative_tokens(seq, max_num_speculative_tokens)
                item = Scheduled(seq, 1 + min(k, budget - 1), False)
            if not self._fit(item, batch, reserved):
                continue
            batch.append(item)
            budget -= item.num_tokens
            reserved += self.cache.blocks_needed(seq.seq_id, item.num_tokens)
        while (only is None and self.waiting and len(self.running) < self.max_num_seqs
               and budget > 0):
            seq = min(self.waiting, key=lambda s: s.request.priority)  # the first of equals
            # Cached blocks are taken now (an evictable one stops being free); given
            # back below if the rest does not fit.
            cached = self.cache.add(seq.seq_id, seq.tokens if seq.use_prefix_cache else (),
                                    features=seq.wants_features,
                                    cache_salt=seq.request.cache_salt)
            n = min(len(seq.tokens) - cached, budget)
            need = self.cache.blocks_needed(seq.seq_id, n)
            if need > self.cache.num_free_blocks - reserved:
                self.cache.free(seq.seq_id)
                break  # wait for room; never fail
            self.waiting.remove(seq)
            if self.cache.enable_prefix_caching:
                self.prefix_cache_stats.record(len(seq.tokens), cached)
            seq.num_computed = cached
            seq.cached_features = cached if seq.wants_features else 0
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(Scheduled(seq, n, True))
            budget -= n
            reserved += need
        return batch

    def _fit(self, item: Scheduled, batch: list[Scheduled], reserved: int) -> bool:
        """Make room in the cache for `item`: drop its K, then preempt the
        newest other running sequence not already in this batch."""
        seq = item.seq
        while (self.cache.blocks_needed(seq.seq_id, item.num_tokens)
               > self.cache.num_free_blocks - reserved):
            if not item.is_prefill and item.num_tokens > 1:
                item.num_tokens = 1
                continue
            in_batch = {s.seq.seq_id for s in batch}
            victims = [s for s in self.running if s is not seq and s.seq_id not in in_batch]
            if not victims:
                return False
            # The newest of those whose priority value is highest.
            self._preempt(max(reversed(victims), key=lambda s: s.request.priority))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
