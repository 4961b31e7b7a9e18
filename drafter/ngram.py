"""Prompt lookup (n-gram) drafting.

The draft for a context copies what followed the latest earlier occurrence
of the context's own last n tokens, trying the longest n first (max_n down
to min_n), as vLLM's ngram proposer and Hugging Face's prompt lookup
decoding do. It needs no model and no hidden states, and it is
deterministic, so its drafts carry no probabilities (one-hot q, exact).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch

from drafter.method import Draft, DrafterInfo, DraftMethod, OutcomeTable
from drafter.registry import register
from specdec.pb import common_pb2
from specdec.sampling import SamplingParams


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram.

    tokens: [L] int. Returns [<= k], empty when no n-gram of at least min_n tokens
    recurs. Linear in L: one comparison over the whole context finds the earlier
    positions holding the last token, then each further step back only checks the
    candidates still matching.
    """
    length = tokens.shape[0]
    if k < 1 or length < 2:
        return tokens[:0]
    # ends: [C] ascending positions j <= L-2 whose token equals the last one; a match
    # ending at j is followed by at least one token (j + 1 <= L - 1) to propose.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return tokens[:0]
    best_end, matched = ends[-1], 1
    for back in range(1, min(max_n, length - 1)):
        ends = ends[ends >= back]
        ends = ends[tokens[ends - back] == tokens[length - 1 - back]]
        if ends.size == 0:
            break
        # Every survivor matches back + 1 tokens; the last one is the latest match.
        best_end, matched = ends[-1], back + 1
    if matched < min_n:
        return tokens[:0]
    return tokens[best_end + 1:best_end + 1 + k]


def continuation_table(tokens: np.ndarray, min_n: int, max_n: int,
                       k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """find_continuation for every one-token extension of a context whose match is at
    least two tokens long, at once.

    tokens: [n] int, n >= 2; max_n >= 2. Returns (bonus [B] ascending, lengths [B],
    drafts [sum(lengths)]): for b == bonus[i], find_continuation(tokens + [b], min_n,
    max_n, k) is the i-th run of `lengths[i]` drafts. For any other b it is empty if
    min_n >= 2, and otherwise copies what followed b's latest occurrence (a one-token
    match, which the verifier copies itself: DraftTable.copy_unlisted). A match of at
    least two tokens ends in the context's last token followed by b, so the only
    candidates are the positions j right after an earlier occurrence of the last token,
    with b = tokens[j].
    """
    n = tokens.shape[0]
    if n < 2 or k < 1 or max_n < 2:
        raise ValueError("continuation_table needs a context of >= 2 tokens, k >= 1, max_n >= 2")
    # j: [C] ascending; tokens[j - 1] is the last token, so b = tokens[j] matches 2 tokens.
    j = np.flatnonzero(tokens[:-1] == tokens[-1]) + 1
    if j.size == 0:
        return tokens[:0], tokens[:0], tokens[:0]
    matched = np.full(j.shape, 2)
    run = np.ones(j.shape, dtype=bool)
    for back in range(2, min(max_n, n)):
        # tokens + [b] has length n + 1; its token `back` before b is tokens[n - back].
        run &= (j >= back) & (tokens[np.maximum(j - back, 0)] == tokens[n - back])
        if not run.any():
            break
        matched += run
    # Per candidate token, the longest match and among those the latest (as
    # find_continuation picks): the last of each token's run after this sort.
    order = np.lexsort((j, matched, tokens[j]))
    cand = tokens[j][order]
    best = order[np.flatnonzero(np.append(cand[1:] != cand[:-1], True))]
    best = best[matched[best] >= min_n]
    bonus, start = tokens[j[best]], j[best] + 1
    # The drafts follow j in tokens + [b]: tokens[j + 1:], then b itself at index n.
    lengths = np.minimum(k, n + 1 - start)
    idx = start[:, None] + np.arange(k)  # [B, k]
    drafts = np.where(idx < n, tokens[np.minimum(idx, n - 1)], bonus[:, None])
    return bonus, lengths, drafts[np.arange(k) < lengths[:, None]]


class TokenBuffer:
    """A sequence's committed tokens: amortised O(1) append, O(1) rollback."""

    def __init__(self, tokens: list[int]):
        self._data = np.empty(max(16, 2 * len(tokens)), dtype=np.int32)
        self._len = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        end = self._len + len(tokens)
        if end > self._data.shape[0]:
            grown = np.empty(2 * end, dtype=np.int32)
            grown[:self._len] = self._data[:self._len]
            self._data = grown
        self._data[self._len:end] = tokens
        self._len = end

    def drop(self, n: int) -> None:
        if n > self._len:
            raise ValueError(f"num_rollback_tokens {n} exceeds the context's {self._len} tokens")
        self._len -= n

    def view(self) -> np.ndarray:
        return self._data[:self._len]  # [L] int32, valid until the next extend

    def __len__(self) -> int:
        return self._len


@register
class NgramMethod(DraftMethod):
    name = "ngram"
    light = True  # vectorised lookups over the context: tens of microseconds a sequence

    def __init__(self, min_n: int = 1, max_n: int = 4, max_num_speculative_tokens: int = 8,
                 vocab_size: int = 0, tokenizer_hash: str = ""):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, "
                             f"max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # Ngram works on ids alone; vocab_size 0 and hash "" say it fits any tokenizer.
        self._info = DrafterInfo(
            method=common_pb2.SPEC_METHOD_NGRAM,
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_hash,
            max_num_speculative_tokens=max_num_speculative_tokens,
        )
        self._contexts: dict[Hashable, TokenBuffer] = {}

    @property
    def num_sequences(self) -> int:
        return len(self._contexts)

    def info(self) -> DrafterInfo:
        return self._info

    def start(self, key: Hashable, prompt_ids: list[int], output_ids: list[int],
              sampling: SamplingParams, max_num_speculative_tokens: int) -> None:
        # Lookup is deterministic whatever the sampling, and reserves nothing per K.
        self._contexts[key] = TokenBuffer(list(prompt_ids) + list(output_ids))

    def advance(self, key: Hashable, num_drafted: int, num_accepted: int, new_token_ids: list[int],
                num_rollback_tokens: int, hidden_states: torch.Tensor | None,
                hidden_start_position: int) -> None:
        # Only the committed tokens matter: accepted drafts arrive in new_token_ids.
        context = self._contexts[key]
        context.drop(num_rollback_tokens)
        context.extend(new_token_ids)

    def propose(self, wanted: dict[Hashable, int]) -> dict[Hashable, Draft]:
        drafts: dict[Hashable, Draft] = {}
        cap = self._info.max_num_speculative_tokens
        for key, k in wanted.items():
            tokens = find_continuation(self._contexts[key].view(), self.min_n, self.max_n,
                                       min(k, cap))
            if tokens.size:
                drafts[key] = Draft(token_ids=tokens.tolist())
        return drafts

    def propose_after(self, key: Hashable, extra: list[int], k: int) -> list[int] | None:
        context = self._contexts[key].view()
        tokens = np.concatenate([context, np.asarray(extra, dtype=context.dtype)])
        return find_continuation(tokens, self.min_n, self.max_n,
                                 min(k, self._info.max_num_speculative_tokens)).tolist()

    def outcome_table(self, key: Hashable, drafts: list[int], k: int) -> OutcomeTable | None:
        # One-token matches (min_n 1) would list every token the context holds: the
        # table lists the longer ones, and the verifier copies after the others itself.
        if self.max_n < 2:
            return None
        context = self._contexts[key].view()
        full = np.concatenate([context, np.asarray(drafts, dtype=context.dtype)])
        k = min(k, self._info.max_num_speculative_tokens)
        empty = (full[:0], full[:0], full[:0])
        return OutcomeTable(
            [continuation_table(full[:len(context) + a], self.min_n, self.max_n, k)
             if len(context) + a >= 2 else empty for a in range(len(drafts) + 1)],
            k, copy_unlisted=self.min_n == 1)

    def free(self, key: Hashable) -> None:
        self._contexts.pop(key, None)

    def has(self, key: Hashable) -> bool:
        return key in self._contexts
