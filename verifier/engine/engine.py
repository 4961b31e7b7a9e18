"""The verifier engine. One step, top to bottom:

    schedule -> drafts -> one ragged target forward -> rejection sampling -> postprocess

Prefill chunks and verify blocks (last token + K_i drafts, K_i per
sequence, 0 allowed) share one forward. Logits are taken only where a token
is sampled: every position of a verify block, and the last position of a
prefill chunk that completes its sequence. Rejected drafts are rolled back
by truncating the sequence in the KV cache.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from specdec.models import LlamaForCausalLM
from verifier.engine.proposer import Proposer
from verifier.engine.scheduler import Scheduled, Scheduler
from verifier.engine.sequence import FinishReason, Request, Sequence, Status
from verifier.sampling.params import SamplingMetadata
from verifier.sampling.rejection import rejection_sample


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_batched_tokens: int = 512  # per step: prefill chunks + verify blocks
    num_speculative_tokens_max: int = 8
    seed: int = 0  # the shared generator of unseeded requests

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "block_size", "num_kv_blocks",
                     "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_speculative_tokens_max < 0:
            raise ValueError("num_speculative_tokens_max must be >= 0")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"KV cache ({self.num_kv_blocks} blocks x {self.block_size}) cannot hold one "
                f"sequence of max_model_len {self.max_model_len}")


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    num_drafted: int  # drafts the target scored for this sequence this step
    num_accepted: int
    finish_reason: FinishReason | None = None


class Engine:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig,
                 proposer: Proposer | None = None, eos_token_ids: frozenset[int] = frozenset()):
        self.model = model
        self.config = config
        self.proposer = proposer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache = model.make_kv_cache(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len)
        self.shared_generator = torch.Generator().manual_seed(config.seed)
        self._by_request: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.step_time_ema_ms = 0.0

    # -- requests ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        vocab = self.model.config.vocab_size
        if request.request_id in self._by_request:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab})")
        if len(request.prompt_token_ids) + request.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(request.prompt_token_ids)}) + max_tokens "
                f"({request.max_tokens}) exceeds max_model_len {self.config.max_model_len}")
        if request.num_speculative_tokens > self.config.num_speculative_tokens_max:
            raise ValueError(
                f"num_speculative_tokens: {request.num_speculative_tokens} exceeds the maximum "
                f"{self.config.num_speculative_tokens_max}")
        seq = Sequence(next(self._ids), request, list(request.prompt_token_ids),
                       request.sampling.make_generator())
        self._by_request[request.request_id] = seq
        self.scheduler.add(seq)
        if self.proposer is not None:
            self.proposer.start(seq.seq_id, list(request.prompt_token_ids),
                                self.config.num_speculative_tokens_max)

    def cancel(self, request_id: str) -> StepOutput | None:
        """Stop a request now; its KV is freed at once."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.CANCELLED)
        return StepOutput(request_id, [], 0, 0, FinishReason.CANCELLED)

    def set_num_speculative_tokens(self, request_id: str, k: int) -> None:
        if not 0 <= k <= self.config.num_speculative_tokens_max:
            raise ValueError(f"num_speculative_tokens must be in [0, "
                             f"{self.config.num_speculative_tokens_max}], got {k}")
        self._by_request[request_id].request.num_speculative_tokens = k

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # -- the step ------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule(self.config.num_speculative_tokens_max)
        if not batch:
            return []
        drafts, draft_probs = self._drafts(batch)
        feeds = [self._feed(item, drafts.get(item.seq.seq_id, [])) for item in batch]
        meta = self.cache.plan([(item.seq.seq_id, len(f)) for item, f in zip(batch, feeds, strict=True)])

        # Rows to sample: every position of a verify block; the last position
        # of a prefill chunk that reaches the end of its sequence.
        sampled: list[tuple[Scheduled, list[int]]] = []
        logit_rows: list[int] = []
        for item, feed, start in zip(batch, feeds, meta.query_start[:-1].tolist(), strict=True):
            if item.is_prefill:
                if item.seq.num_computed + len(feed) == len(item.seq.tokens):
                    sampled.append((item, []))
                    logit_rows.append(start + len(feed) - 1)
            else:
                draft = feed[1:]
                sampled.append((item, draft))
                logit_rows.extend(range(start, start + len(feed)))

        ids = torch.tensor([t for f in feeds for t in f], device=self.model.device)
        out = self.model(ids, meta, self.cache,
                         logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=ids.device))
        for item, feed in zip(batch, feeds, strict=True):
            if item.is_prefill:
                item.seq.num_computed += len(feed)

        outputs: list[StepOutput] = []
        if sampled:
            outputs = self._sample_and_advance(sampled, out.logits, draft_probs)
        dt = (time.perf_counter() - t0) * 1e3
        self.step_time_ema_ms = dt if not self.step_time_ema_ms else 0.9 * self.step_time_ema_ms + 0.1 * dt
        return outputs

    def _drafts(self, batch: list[Scheduled]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Draft ids per sequence, and the draft distributions [K_i, V] of the
        proposals that carry them (the others are one-hot)."""
        wanted = {item.seq.seq_id: item.k for item in batch if item.k > 0}
        if not wanted or self.proposer is None:
            return {}, {}
        tokens = {item.seq.seq_id: item.seq.tokens for item in batch if item.k > 0}
        proposals = self.proposer.propose(wanted, tokens)
        vocab = self.model.config.vocab_size
        drafts, probs = {}, {}
        for seq_id, k in wanted.items():
            p = proposals.get(seq_id)
            if p is not None:
                # A drafter can only lower K; out-of-vocabulary ids end the draft.
                ids = list(itertools.takewhile(lambda t: 0 <= t < vocab, p.token_ids[:k]))
                if p.probs is not None and ids:
                    if p.probs.dim() != 2 or p.probs.shape[0] < len(ids) or p.probs.shape[1] != vocab:
                        continue  # a malformed q can't be verified exactly: run K = 0
                    probs[seq_id] = p.probs[: len(ids)]
                drafts[seq_id] = ids
        return drafts, probs

    @staticmethod
    def _feed(item: Scheduled, draft: list[int]) -> list[int]:
        seq = item.seq
        if item.is_prefill:
            return seq.tokens[seq.num_computed: seq.num_computed + item.num_tokens]
        return [seq.tokens[-1], *draft]

    def _sample_and_advance(self, sampled: list[tuple[Scheduled, list[int]]],
                            logits: torch.Tensor,
                            draft_probs: dict[int, torch.Tensor]) -> list[StepOutput]:
        seqs = [item.seq for item, _ in sampled]
        num_drafts = torch.tensor([len(d) for _, d in sampled], dtype=torch.int64)
        draft_ids = torch.tensor([t for _, d in sampled for t in d], dtype=torch.int64)
        q = None
        if draft_probs:
            # [sum K_i, V]: the drafter's q where it sent one, one-hot rows elsewhere.
            q = torch.nn.functional.one_hot(draft_ids, logits.shape[-1]).float()
            row = 0
            for seq, (_, draft) in zip(seqs, sampled, strict=True):
                if seq.seq_id in draft_probs:
                    q[row: row + len(draft)] = draft_probs[seq.seq_id].float()
                row += len(draft)
        metadata = SamplingMetadata.from_params(
            [s.request.sampling for s in seqs], [s.generator for s in seqs], self.shared_generator)
        out_ids, num_accepted = rejection_sample(logits, draft_ids, q, num_drafts, metadata)
        out_ids, num_accepted = out_ids.tolist(), num_accepted.tolist()
        outputs = []
        for (item, draft), row, accepted in zip(sampled, out_ids, num_accepted, strict=True):
            seq = item.seq
            new = row[: accepted + 1]
            if not item.is_prefill:
                # KV was written for the last token and every draft; keep the
                # accepted ones (the sampled token has none yet).
                self.cache.truncate(seq.seq_id, seq.num_computed + 1 + accepted)
            appended, reason = self._append(seq, new)
            seq.num_computed = len(seq.tokens) - 1
            seq.num_drafted += len(draft)
            seq.num_accepted += min(accepted, len(appended))
            if self.proposer is not None and reason is None:
                self.proposer.advance(seq.seq_id, len(draft), accepted, appended)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(StepOutput(seq.request.request_id, appended, len(draft), accepted, reason))
        return outputs

    def _append(self, seq: Sequence, new: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append sampled tokens up to the first stop condition."""
        req = seq.request
        appended = []
        for tok in new:
            seq.tokens.append(tok)
            appended.append(tok)
            if not req.ignore_eos and tok in self.eos_token_ids:
                return appended, FinishReason.EOS
            if tok in req.stop_token_ids:
                return appended, FinishReason.STOP_TOKEN
            if seq.num_output >= req.max_tokens or len(seq.tokens) >= self.config.max_model_len:
                return appended, FinishReason.LENGTH
        return appended, None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self._by_request.pop(seq.request.request_id, None)
        if self.proposer is not None:
            self.proposer.free(seq.seq_id)
