"""Logits processors with vLLM's meanings (presence, frequency and repetition
penalties, logit_bias, min_tokens, bad_words, allowed_token_ids), exact under
speculation.

The verifier scores a block of rows per sequence: row j is the position after
drafts d_1..d_j. Plain decoding would have applied the processors there with
d_1..d_j already in the output, so `apply_block` does exactly that: every count,
every "output so far" of row j includes the drafts before it. The processed rows
are what the rejection sampler (greedy argmax included) scores; logprobs stay
those of the raw target distribution, as vLLM reports them by default.

Order, as vLLM's sampler: allowed_token_ids, bad_words, min_tokens, logit_bias,
then the penalties (repetition, frequency, presence); temperature and the
top-k/top-p/min-p filters follow in the sampler.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from specdec.pb import common_pb2

# vLLM's and OpenAI's ranges.
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
# Bounds on the lists a request may carry: each is work on every verified row.
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 64


@dataclass(frozen=True, slots=True)
class LogitsProcessors:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens
                    or self.bad_words or self.allowed_token_ids)

    @classmethod
    def from_proto(cls, s: common_pb2.SamplingParams, vocab_size: int,
                   field: str = "sampling") -> LogitsProcessors:
        """ValueError naming `field`.<name> (just <name> for an empty field) for anything
        out of range."""
        pre = f"{field}." if field else ""

        def finite(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> float:
            ok = math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
            if not ok:
                bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
                raise ValueError(f"{pre}{name}: must be in {bound}, got {value}")
            return float(value)

        def token(name: str, t: int) -> int:
            if not 0 <= t < vocab_size:
                raise ValueError(f"{pre}{name}: token id {t} outside the vocabulary "
                                 f"(size {vocab_size})")
            return int(t)

        presence = finite("presence_penalty", s.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        frequency = finite("frequency_penalty", s.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        repetition = 1.0
        if s.HasField("repetition_penalty"):
            repetition = finite("repetition_penalty", s.repetition_penalty, 0.0, MAX_PENALTY,
                                lo_open=True)
        if len(s.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"{pre}logit_bias: at most {MAX_LOGIT_BIAS} entries")
        bias = tuple(sorted((token("logit_bias", t), finite("logit_bias", b, -MAX_BIAS, MAX_BIAS))
                            for t, b in s.logit_bias.items()))
        if len(s.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"{pre}bad_words: at most {MAX_BAD_WORDS} entries")
        bad = []
        for w in s.bad_words:
            if not w.ids or len(w.ids) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"{pre}bad_words: each between 1 and "
                                 f"{MAX_BAD_WORD_TOKENS} tokens")
            bad.append(tuple(token("bad_words", t) for t in w.ids))
        allowed = tuple(sorted({token("allowed_token_ids", t) for t in s.allowed_token_ids}))
        return cls(presence, frequency, repetition, bias, int(s.min_tokens), tuple(bad), allowed)


def apply_block(
    logits: torch.Tensor,  # [rows, V], processed in place
    p: LogitsProcessors,
    prompt: Sequence[int],
    output: Sequence[int],
    drafts: Sequence[int],  # [rows - 1]: row j sees drafts[:j] as output
    stop_ids: Collection[int],  # end-of-sequence and stop_token_ids, for min_tokens
) -> None:
    rows, vocab = logits.shape
    dev = logits.device
    if p.allowed_token_ids:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[list(p.allowed_token_ids)] = True
        logits.masked_fill_(~keep, float("-inf"))
    counts = None
    if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0:
        # [rows, V]: occurrences in the output, plus the drafts before each row.
        counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=dev)
        if output:
            counts += torch.bincount(torch.tensor(output, device=dev), minlength=vocab)[:vocab]
        for j in range(1, rows):
            counts[j:, drafts[j - 1]] += 1
    for j in range(rows):
        out_len = len(output) + j
        row = logits[j]
        if p.bad_words:
            tail = list(output[-MAX_BAD_WORD_TOKENS:]) + list(drafts[:j])
            for w in p.bad_words:
                if len(w) == 1 or (len(tail) >= len(w) - 1 and tuple(tail[len(tail) - len(w) + 1:])
                                   == w[:-1]):
                    row[w[-1]] = float("-inf")
        if out_len < p.min_tokens and stop_ids:
            row[list(stop_ids)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
        logits[:, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype,
                                       device=dev)
    if p.repetition_penalty != 1.0:
        seen = counts > 0  # [rows, V]
        if prompt:
            seen[:, torch.tensor(list(prompt), device=dev)] = True
        r = p.repetition_penalty
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    if p.frequency_penalty:
        logits -= p.frequency_penalty * counts
    if p.presence_penalty:
        logits -= p.presence_penalty * (counts > 0).to(logits.dtype)
