"""The verifier engine. One step, top to bottom:

    schedule -> drafts -> run -> sample -> postprocess

The scheduler picks the sequences and their K (scheduler.py); the proposer's
drafts are cut to what can be verified (drafts.py); the model runner plans the
batch in the KV cache and runs one ragged target forward over prefill chunks
and verify blocks (runner.py); a tree block's accepted path becomes a chain
(verifier/sampling/tree_acceptance.py) and every chain is rejection-sampled;
each sampled sequence then keeps the KV of what was accepted (rejected drafts
are rolled back by truncating it in the cache), appends its new tokens up to a
stop condition and reports the outcome to its drafter. Every full block of
committed tokens is then registered in the prefix cache
(specdec/models/prefix_cache.py), for later sequences to reuse.

A step changes nothing for good before it commits (after sampling): one that
raises before then is undone (StepFailed), so it can be run again, whole or for
some of its requests (`step(only=...)`), which is how the worker finds a request
that makes steps fail (verifier/worker.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from specdec.models import LlamaForCausalLM
from specdec.processors import apply_block
from specdec.sampling import SamplingMetadata
from specdec.structured import allowed_tokens
from verifier.engine.drafts import collect_drafts
from verifier.engine.proposer import Outcome, Proposer
from verifier.engine.runner import Hidden, ModelRunner, RunnerOutput
from verifier.engine.scheduler import Scheduled, Scheduler
from verifier.engine.sequence import (
    FinishReason,
    Request,
    Sequence,
    Status,
)
from verifier.engine.speculation import Row, SpeculationController, ready_row
from verifier.sampling.rejection import greedy_chains
from verifier.sampling.sampler import rejection_sample
from verifier.sampling.tree_acceptance import Chains, chain_blocks

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 32
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_batched_tokens: int = 512  # per step: prefill chunks + verify blocks
    max_num_speculative_tokens: int = 8
    seed: int = 0  # the shared generator of unseeded requests
    cuda_graphs: bool = True  # replay pure decode/verify steps from CUDA graphs (GPU only)
    enable_prefix_caching: bool = True  # reuse the KV of cached full blocks (prefix_cache.py)
    # Choose dynamic-K requests' K each step here (verifier/engine/speculation.py);
    # off, a dynamic-K request drafts its bound every step.
    speculation_controller: bool = True
    # Steps taken while the engine holds more requests than this (running and waiting)
    # draft nothing, reported as "queue_size"; None: never.
    disable_queue_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "block_size", "num_kv_blocks",
                     "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_speculative_tokens < 0:
            raise ValueError("max_num_speculative_tokens must be >= 0")
        if self.disable_queue_size is not None and self.disable_queue_size < 0:
            raise ValueError(f"disable_queue_size must be >= 0, got {self.disable_queue_size}")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"KV cache ({self.num_kv_blocks} blocks x {self.block_size}) cannot hold one "
                f"sequence of max_model_len {self.max_model_len}")


@dataclass(slots=True)
class StepTimes:
    """Where the engine's time went, cumulative since it started (milliseconds).

    A step is schedule -> drafts (waiting for the proposer) -> forward (the model
    runner: batch building and the target forward) -> sample (tree chains and
    rejection sampling) -> postprocess (KV rollback, appends, stop checks, drafter
    outcomes). `steps` counts steps that ran a batch, `tokens` the tokens they emitted."""

    steps: int = 0
    tokens: int = 0
    sequences: int = 0  # summed batch sizes
    rows: int = 0  # summed query rows fed (prefill chunks, 1 + drafts per verified sequence)
    schedule_ms: float = 0.0
    draft_wait_ms: float = 0.0
    drafter_ms: float = 0.0  # of draft_wait_ms: inside the drafters, as they report it
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    postprocess_ms: float = 0.0

    @property
    def busy_ms(self) -> float:
        return (self.schedule_ms + self.draft_wait_ms + self.forward_ms + self.sample_ms
                + self.postprocess_ms)  # drafter_ms is part of draft_wait_ms


@dataclass(slots=True)
class TokenLogprob:
    """Raw log_softmax of the target logits (before temperature and filters)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id among all tokens
    top: list[tuple[int, float]]  # the request's num_logprobs most likely (id, logprob)


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    num_drafted: int  # drafts the target scored for this sequence this step
    num_accepted: int
    finish_reason: FinishReason | None = None
    num_speculative_tokens: int = 0  # K the scheduler gave the sequence this step
    # Why the step fed no drafts for a request that asks for them: the engine ran it
    # plain (Scheduled.plain_reason), or none arrived although K > 0 (Proposer.miss_reason).
    miss_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked
    # The step as a whole, the same for every output of one step.
    step: int = 0
    batch_size: int = 0
    num_tokens: int = 0  # rows fed in the whole step (prefill chunks, 1 + drafts per block)
    step_time_ms: float = 0.0
    draft_wait_ms: float = 0.0
    # The request failed on its own while its step committed (a grammar that refuses
    # the token sampled under it, say): it is gone (finish_reason CANCELLED), the
    # requests beside it went on.
    error: Exception | None = None


class NoTokenAllowed(ValueError):
    """The request's own constraints (its grammar with allowed_token_ids, bad_words,
    min_tokens, logit_bias) leave no token at a position it reached: the client's error,
    which plain decoding meets at the same position. The request ends with it; the others
    go on."""


class StepFailed(Exception):
    """A step raised before it committed anything (the cause is __cause__). Its
    sequences are as they were before it: the KV it appended is rolled back, the
    random generators it drew from are restored, no token was emitted and no outcome
    reached the proposer (the proposals it waited for count as late). So the step can
    run again, whole or in part."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"a step of {len(request_ids)} requests failed")
        self.request_ids = request_ids  # the requests the step ran, in batch order


class Engine:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig,
                 proposer: Proposer | None = None, eos_token_ids: frozenset[int] = frozenset()):
        self.model = model
        self.config = config
        self.proposer = proposer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.runner = ModelRunner(
            model, num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_query_len=config.max_num_speculative_tokens + 1,
            max_model_len=config.max_model_len, cuda_graphs=config.cuda_graphs,
            enable_prefix_caching=config.enable_prefix_caching)
        self.cache = self.runner.cache
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len)
        # Generators live where the logits are: torch draws on a device only from its own.
        self.shared_generator = torch.Generator(device=model.device).manual_seed(config.seed)
        self._by_request: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.step_time_ema_ms = 0.0
        self.num_steps = 0
        self.times = StepTimes()
        # Plain steps' hidden rows reach the proposer as places in the feature store.
        self._lazy_features = proposer is not None and proposer.bind_feature_reader(
            self._read_features)
        self.controller = SpeculationController() if config.speculation_controller else None
        # seq_id -> the first row of its block this step whose processed logits allow no
        # token (_processed), for the sequences that have one.
        self._dead_rows: dict[int, int] = {}

    # -- requests ----------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise ValueError, naming the field, for a request this engine cannot run.
        Reads only configuration, so any thread may call it."""
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab})")
        if len(request.prompt_token_ids) + request.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(request.prompt_token_ids)}) + max_tokens "
                f"({request.max_tokens}) exceeds max_model_len {self.config.max_model_len}")
        if request.num_speculative_tokens > self.config.max_num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens: {request.num_speculative_tokens} exceeds the maximum "
                f"{self.config.max_num_speculative_tokens}")

    def add_request(self, request: Request) -> None:
        """Queue a request; the scheduler admits it when there is room.

        Prefix-cache hits and drafters that read hidden states (EAGLE, EAGLE-3): the
        drafter builds its context from the target's hidden states of every position,
        and a hit computes none for the cached positions. So the cache keeps the rows
        of those layers beside the KV (PagedKVCache.keep_features): such a sequence
        takes only cached blocks that carry them, and its drafter receives the cached
        rows of the positions it skipped, the same rows a full prefill would have
        given it (tested in float64). A drafter that wants other layers than the cache
        keeps takes no hits. A sequence whose drafter is unreachable keeps no features
        and takes hits; the drafter, once back, re-starts it from the tokens.
        """
        if request.request_id in self._by_request:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.validate(request)
        seq = Sequence(next(self._ids), request, list(request.prompt_token_ids))
        self._by_request[request.request_id] = seq
        self.scheduler.add(seq)
        if self.proposer is not None:
            self.proposer.start(seq.seq_id, request)
            layers = self.proposer.hidden_layers(seq.seq_id)
            if layers:
                seq.wants_features = self.cache.keep_features(
                    layers, self.model.config.hidden_size)
                seq.use_prefix_cache = seq.wants_features

    def cancel(self, request_id: str) -> StepOutput | None:
        """Stop a request now; its KV is freed at once."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.CANCELLED)
        return StepOutput(request_id, [], 0, 0, FinishReason.CANCELLED)

    def set_num_speculative_tokens(self, request_id: str, k: int, auto_k: bool = False) -> None:
        """The request's K from its next step on; auto_k: K is a bound, chosen within
        each step by the controller."""
        if not 0 <= k <= self.config.max_num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in [0, "
                             f"{self.config.max_num_speculative_tokens}], got {k}")
        request = self._by_request[request_id].request
        request.num_speculative_tokens, request.auto_k = k, auto_k

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # -- the step ------------------------------------------------------------

    def step(self, only: Collection[str] | None = None) -> list[StepOutput]:
        """only: step just these running requests (by request id), admitting none.
        Raises StepFailed, with the step undone, when it raises before committing."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule(self.config.max_num_speculative_tokens, only)
        if not batch:
            return []
        self.num_steps += 1
        generators = self._generator_states(batch)
        rows = self._choose_k(batch)
        try:
            t1 = time.perf_counter()
            drafts = collect_drafts(self.proposer, batch, self.model.config)
            t2 = time.perf_counter()
            out = self.runner.run(batch, drafts, self.proposer)
            t3 = t4 = time.perf_counter()
            if out.sampled:
                chains = chain_blocks(out.logits, out.drafts,
                                      [drafts.trees.get(item.seq.seq_id) for item in out.sampled])
                # The runner's argmax holds for rows no tree chose among.
                argmax = out.argmax if chains.logits is out.logits else None
                token_ids, num_accepted = self._sample(out.sampled, chains, drafts.probs, argmax)
                t4 = time.perf_counter()
        except Exception as e:
            self._undo(batch, generators)
            raise StepFailed([item.seq.request.request_id for item in batch]) from e
        # Commit: from here on the sequences move forward.
        self._advance_prefill(batch, out.hidden)
        outputs: list[StepOutput] = []
        if out.sampled:
            outputs = self._postprocess(out, chains, token_ids, num_accepted)
        t5 = time.perf_counter()
        if self.controller is not None and out.sampled:
            outcomes = {item.seq.seq_id: (len(fed), accepted) for item, fed, accepted
                        in zip(out.sampled, out.drafts, num_accepted, strict=True)
                        if item.num_speculative_tokens}
            self.controller.observe(rows, outcomes, (t5 - t0 - (t2 - t1)) * 1e3,
                                    (t2 - t1) * 1e3, out.num_tokens, drafts.trees)
        self._account(t0, t1, t2, t3, t4, t5, len(batch), out.num_tokens, outputs)
        dt = (t5 - t0) * 1e3
        self.step_time_ema_ms = dt if not self.step_time_ema_ms else 0.9 * self.step_time_ema_ms + 0.1 * dt
        draft_wait_ms = (t2 - t0) * 1e3  # scheduling included, as the step stats always had it
        for o in outputs:
            o.step, o.batch_size, o.step_time_ms, o.draft_wait_ms = self.num_steps, len(batch), dt, draft_wait_ms
            o.num_tokens = out.num_tokens
        return outputs

    def _choose_k(self, batch: list[Scheduled]) -> list[Row]:
        """Each sequence's K this step where the engine chooses it, within the K the
        scheduler gave it: none past the queue size, dynamic K's by the controller.
        Returns the step's rows for the controller to learn from (none without one)."""
        limit = self.config.disable_queue_size
        if limit is not None and self.num_running + self.num_waiting > limit:
            for item in batch:
                if item.num_speculative_tokens:
                    item.num_tokens, item.plain_reason = 1, "queue_size"
        if self.controller is None:
            return []
        rows = [ready_row(item.seq.seq_id, item.num_speculative_tokens,
                          item.seq.request.drafter if item.seq.request.auto_k else None,
                          self.proposer, item.is_prefill)
                for item in batch]
        chosen = self.controller.choose(rows)
        for item, row in zip(batch, rows, strict=True):
            k = chosen.get(row.key)
            if k is None and row.bet and item.num_speculative_tokens:
                k = 0  # a table said "none": nothing to ask for this step
            if k is not None:
                item.num_tokens = 1 + k
                item.plain_reason = None if k else "dynamic_k"
        return rows

    def _generator_states(self, batch: list[Scheduled]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The random generators the batch may draw from, with their states now: none
        for an all-greedy batch, which draws nothing."""
        if all(item.seq.request.sampling.is_greedy for item in batch):
            return []
        # Seeded requests' noise is keyed by position: only the shared one has a state.
        return [(self.shared_generator, self.shared_generator.get_state())]

    def _undo(self, batch: list[Scheduled], generators: list[tuple[torch.Generator, torch.Tensor]]
              ) -> None:
        """Before the commit, a step has only appended KV past each sequence's computed
        tokens (a newly admitted one keeps its admission: its prefix-cache blocks) and
        drawn random numbers: roll both back. The KV cut lands at the end of the
        committed blocks, so no shared block is touched."""
        for item in batch:
            seq_id, computed = item.seq.seq_id, item.seq.num_computed
            if seq_id in self.cache and self.cache.length(seq_id) > computed:
                self.cache.truncate(seq_id, computed)
        for g, state in generators:
            g.set_state(state)

    def _account(self, t0: float, t1: float, t2: float, t3: float, t4: float, t5: float,
                 batch_size: int, rows: int, outputs: list[StepOutput]) -> None:
        tm = self.times
        tm.steps += 1
        tm.sequences += batch_size
        tm.rows += rows
        tm.tokens += sum(len(o.new_token_ids) for o in outputs)
        tm.schedule_ms += (t1 - t0) * 1e3
        tm.draft_wait_ms += (t2 - t1) * 1e3
        if self.proposer is not None:
            tm.drafter_ms += self.proposer.drafter_ms()
        tm.forward_ms += (t3 - t2) * 1e3
        tm.sample_ms += (t4 - t3) * 1e3
        tm.postprocess_ms += (t5 - t4) * 1e3

    def _advance_prefill(self, batch: list[Scheduled], hidden: Hidden) -> None:
        """Every prefill chunk's KV is now computed. A chunk that leaves its sequence
        in prefill emits no token, but its hidden states are the drafter's features
        for these positions."""
        for item in batch:
            if item.is_prefill and item.seq.cached_features:
                # First the rows of the positions the prefix cache gave it.
                n, seq = item.seq.cached_features, item.seq
                item.seq.cached_features = 0
                if self._lazy_features:
                    self.proposer.advance(seq.seq_id, Outcome(0, 0, [], hidden_kept=n))
                else:
                    rows = self.cache.read_features(seq.seq_id, n)  # [n, L * hidden]
                    self.proposer.advance(seq.seq_id, Outcome(
                        0, 0, [], rows.view(n, len(self.cache.feature_layers), -1), 0))
            if item.is_prefill:
                start_pos = item.seq.num_computed
                item.seq.num_computed += item.num_tokens
                self.cache.commit(item.seq.seq_id, item.seq.tokens, item.seq.num_computed)
                if item.seq.in_prefill and item.seq.seq_id in hidden.first_row:
                    self.proposer.advance(item.seq.seq_id, self._plain_outcome(
                        item.seq.seq_id, [], hidden, item.num_tokens, start_pos))

    def _sample(self, sampled: list[Scheduled], chains: Chains,
                draft_probs: dict[int, torch.Tensor],
                argmax: torch.Tensor | None) -> tuple[list[list[int]], list[int]]:
        """Rejection-sample every sequence's chain. Returns per sequence its row of
        output ids (the first num_accepted + 1 are its new tokens) and num_accepted.
        argmax: [N] the argmax of chains.logits' rows where the runner took it (inside a
        CUDA graph), else None."""
        seqs = [item.seq for item in sampled]
        params = [s.request.sampling for s in seqs]
        if all(p.is_greedy for p in params):
            logits = self._processed(chains, seqs)
            # The runner's argmax holds while no processor or grammar rewrote the rows.
            if argmax is None or logits is not chains.logits:
                argmax = logits.argmax(dim=-1)
            return greedy_chains(argmax.tolist(), chains.drafts)
        dev, i64 = chains.logits.device, torch.int64
        num_drafts = torch.tensor([len(d) for d in chains.drafts], dtype=i64, device=dev)  # [B]
        # [sum K_i]: the chains' drafts, concatenated
        draft_ids = torch.tensor([t for d in chains.drafts for t in d], dtype=i64, device=dev)
        q = None
        if draft_probs:
            blocks = [(draft_probs.get(s.seq_id), len(d))
                      for s, d in zip(seqs, chains.drafts, strict=True)]
            q = _draft_q(draft_ids, chains.logits.shape[-1], blocks)
        # Seeded requests draw no generator's state: their noise is keyed by (seed,
        # position of the token), so a resumed or re-batched request samples the same.
        metadata = SamplingMetadata.from_params(params, [None] * len(seqs), self.shared_generator,
                                                device=dev, position_keyed=True)
        keys = [(p.seed, len(s.tokens)) if p.seed is not None else None
                for p, s in zip(params, seqs, strict=True)]
        logits = self._processed(chains, seqs)
        out_ids, num_accepted = rejection_sample(
            logits, draft_ids, q, num_drafts, metadata, keys,
            argmax if logits is chains.logits else None)
        return out_ids.tolist(), num_accepted.tolist()

    def _processed(self, chains: Chains, seqs: list[Sequence]) -> torch.Tensor:
        """chains.logits [N, V] as each request's logits processors and grammar leave
        them, row j of a sequence's block seeing its drafts 1..j as output: the target
        distribution plain decoding would sample from, at every position verified. The
        raw rows stay in chains.logits for logprobs."""
        self._dead_rows = {}
        if all(s.request.grammar is None and s.request.processors is None for s in seqs):
            return chains.logits
        logits = chains.logits.clone()
        bitmask = None
        row = 0
        for seq, chain in zip(seqs, chains.drafts, strict=True):
            rows = slice(row, row + len(chain) + 1)
            req = seq.request
            if req.processors is not None:
                stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos
                                                      else set(self.eos_token_ids))
                apply_block(logits[rows], req.processors, req.prompt_token_ids,
                            seq.output_ids, chain, stop_ids)
            if req.grammar is not None:
                if bitmask is None:
                    bitmask = req.grammar.new_bitmask(logits.shape[0])  # [N, ceil(V / 32)]
                req.grammar.fill_masks(chain, bitmask, row)
            row = rows.stop
        if bitmask is not None:
            allowed = allowed_tokens(bitmask, logits.shape[-1]).to(logits.device)  # [N, V]
            logits.masked_fill_(~allowed, float("-inf"))
        dead = (logits == float("-inf")).all(dim=-1).nonzero().flatten().tolist()  # rows
        if dead:
            row = 0
            for seq, chain in zip(seqs, chains.drafts, strict=True):
                first = next((r - row for r in dead if row <= r <= row + len(chain)), None)
                if first is not None:
                    self._dead_rows[seq.seq_id] = first
                row += len(chain) + 1
        return logits

    def _postprocess(self, out: RunnerOutput, chains: Chains, token_ids: list[list[int]],
                     num_accepted: list[int]) -> list[StepOutput]:
        """Each sampled sequence in batch order: keep the KV of what was accepted, append
        the new tokens up to a stop condition, report to the proposer, finish."""
        outputs = []
        row = 0  # first row of the sequence's chain in chains.logits
        for item, fed, chain, path, ids, accepted in zip(
                out.sampled, out.drafts, chains.drafts, chains.paths, token_ids, num_accepted,
                strict=True):
            logits = chains.logits[row: row + len(chain) + 1]  # [len(chain) + 1, V]
            row += len(chain) + 1
            try:
                outputs.append(self._postprocess_seq(item, len(fed), path, ids[: accepted + 1],
                                                     accepted, logits, out.hidden))
            except Exception as e:  # noqa: BLE001 - its own failure ends only this request
                log.exception("request %s failed in postprocess", item.seq.request.request_id)
                self._finish(item.seq, FinishReason.CANCELLED)
                outputs.append(StepOutput(item.seq.request.request_id, [], 0, 0,
                                          FinishReason.CANCELLED, error=e))
        return outputs

    def _postprocess_seq(self, item: Scheduled, num_drafted: int, path: list[int] | None,
                         new: list[int], accepted: int, logits: torch.Tensor,
                         hidden: Hidden) -> StepOutput:
        """new: the accepted drafts and the sampled token; path: the accepted tree
        indices of a tree block; logits: [len(chain) + 1, V], the rows the sampler read."""
        seq = item.seq
        dead = self._dead_rows.get(seq.seq_id)
        if dead is not None and dead <= accepted:  # the token sampled at a row with none allowed
            raise NoTokenAllowed(
                f"sampling: the request's constraints allow no token at output position "
                f"{seq.num_output + dead}: its grammar, allowed_token_ids, bad_words, "
                f"min_tokens and logit_bias together leave none")
        start_pos = seq.num_computed if not item.is_prefill else seq.num_computed - item.num_tokens
        if not item.is_prefill:
            self._keep_accepted_kv(seq, path, accepted)
        appended, reason = self._append(seq, new)
        if seq.request.grammar is not None:
            seq.request.grammar.accept(appended)
        seq.num_computed = len(seq.tokens) - 1
        # Only now is it known which drafts were accepted: register the full blocks of
        # committed tokens (before a finish frees them into the evictable LRU).
        self.cache.commit(seq.seq_id, seq.tokens, seq.num_computed)
        seq.num_drafted += num_drafted
        seq.num_accepted += min(accepted, len(appended))
        logprobs = None
        if seq.request.num_logprobs:
            logprobs = _logprobs(logits[: len(appended)], appended, seq.request.num_logprobs)
        if self.proposer is not None and reason is None:
            # Hidden rows kept: a whole prefill chunk, or the last token plus the accepted drafts.
            kept = item.num_tokens if item.is_prefill else accepted + 1
            if not num_drafted:
                outcome = self._plain_outcome(seq.seq_id, appended, hidden, kept, start_pos)
            else:
                tree_rows = None if path is None else [0, *(1 + j for j in path[:accepted])]
                outcome = Outcome(num_drafted, accepted, appended,
                                  hidden.take(seq.seq_id, self.proposer, kept, tree_rows),
                                  start_pos)
            self.proposer.advance(seq.seq_id, outcome)
        miss = item.plain_reason
        if item.num_speculative_tokens and not num_drafted and self.proposer is not None:
            miss = self.proposer.miss_reason(seq.seq_id)
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request.request_id, appended, num_drafted, accepted, reason,
                          item.num_speculative_tokens, miss, logprobs)

    def _plain_outcome(self, seq_id: int, appended: list[int], hidden: Hidden, kept: int,
                       start_pos: int) -> Outcome:
        """The outcome of a step that fed no drafts (a prefill chunk or a plain decode),
        its hidden rows (kept of them from start_pos) left in the feature store where the
        runner wrote them (runner._keep_features: the sequence keeps features, and its
        drafter reads the layers kept), else taken out of the step's."""
        if (self._lazy_features and seq_id in hidden.first_row
                and self.cache.wants_features(seq_id)
                and self.proposer.hidden_layers(seq_id) == self.cache.feature_layers):
            return Outcome(0, 0, appended, None, start_pos, hidden_kept=kept)
        return Outcome(0, 0, appended, hidden.take(seq_id, self.proposer, kept), start_pos)

    def _read_features(self, seq_id: int, start: int, num: int) -> torch.Tensor | None:
        """[num, L * hidden] feature rows of the sequence's positions start.., or None
        where it no longer holds them all (Proposer.bind_feature_reader)."""
        if (seq_id not in self.cache or not self.cache.wants_features(seq_id)
                or self.cache.length(seq_id) < start + num):
            return None
        return self.cache.read_features(seq_id, num, start)

    def _keep_accepted_kv(self, seq: Sequence, path: list[int] | None, accepted: int) -> None:
        """KV was written for the last token and every draft; keep the accepted ones
        (the sampled token has none yet), a tree's path moved to consecutive slots."""
        if path is not None and path[:accepted] != list(range(accepted)):
            base = seq.num_computed + 1
            self.cache.move(seq.seq_id, [base + j for j in path[:accepted]],
                            list(range(base, base + accepted)))
        self.cache.truncate(seq.seq_id, seq.num_computed + 1 + accepted)

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
        if self.controller is not None:
            self.controller.forget(seq.seq_id)


def _draft_q(draft_ids: torch.Tensor, vocab: int,
             blocks: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor:
    """[sum K_i, V]: the drafter's q where it sent one, one-hot rows elsewhere.
    draft_ids: [sum K_i]; blocks: per sequence its [K_i, V] q (or None) and K_i."""
    q = torch.nn.functional.one_hot(draft_ids, vocab).float()
    row = 0
    for probs, k in blocks:
        if probs is not None:
            q[row: row + k] = probs.to(q.device, torch.float32)
        row += k
    return q


def _logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """logits: [N, V] raw target logits of the rows that emitted token_ids (N = len(token_ids))."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])  # [N, 1]
    ranks = (lp > chosen).sum(dim=1) + 1  # [N]
    top_lp, top_ids = lp.topk(min(num_top, lp.shape[-1]), dim=-1)  # [N, num_top]
    return [
        TokenLogprob(t, c, r, list(zip(ti, tl, strict=True)))
        for t, c, r, ti, tl in zip(token_ids, chosen[:, 0].tolist(), ranks.tolist(),
                                   top_ids.tolist(), top_lp.tolist(), strict=True)
    ]

