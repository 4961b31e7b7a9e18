"""Our drafter services inside vLLM: a proposer for its `custom_class` speculative method.

    vllm serve MODEL --speculative-config '{"method": "custom_class",
        "model": "verifier.vllm.RemoteProposer", "num_speculative_tokens": 8}' \
      --additional-config '{"specdec": {"drafters": {"ngram": "127.0.0.1:50061"}}}'

vLLM builds the class in its model runner (in the engine-core process, or each worker's)
with the VllmConfig alone, calls `load_model(model)` once the target is loaded, and after
every step `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`, which
returns one draft list per running request, of any length (vLLM schedules that many, and
verifies them as one-hot drafts, which is exact for any draft rule). It is the verifier
engine's drafter pool (verifier/drafting.py) behind another front: one Draft stream per
drafter service, each step's outcomes and K sent together, proposals awaited up to the
draft deadline; a drafter that is late, down or hung leaves its requests without drafts
for the step while it reconnects in the background, and nothing here raises into vLLM.

**Request identity.** `propose` gets the batch's tokens but no request ids, and a
request's policy (method, drafter, K) lives in its SamplingParams.extra_args
(verifier/vllm/policy.py). Both are the model runner's: `runner.input_batch.req_ids`
names the batch rows in the order of `sampled_token_ids`, and `runner.requests[id]`
holds each request's SamplingParams. The runner builds this class in its own
constructor (`self.drafter = create_custom_proposer(self.vllm_config)`), so the
constructor finds it as the `self` of a calling frame, once, checked by type, and fails
vLLM's start-up loudly if it is not there. Considered and left: a vLLM general plugin
patching GPUModelRunner would change every vLLM process of the environment at import
time and break whenever the patched method does; a worker extension handing the runner
over needs a collective RPC that `vllm serve` never makes; a logits processor sees batch
changes but no ids, and would have to share state with the proposer through a global;
matching requests by their tokens is ambiguous for equal prompts.

A request's drafter context is the runner's own row of token ids, so a request whose
context moved in a way its tokens do not explain (preempted and re-prefilled) is simply
re-started on its drafter. Drafters get greedy sampling: vLLM verifies custom drafts as
one-hot, for which the most likely token is the best draft, and cannot use a q.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.sampling import SamplingParams
from specdec.server import INTERNAL_TOKEN_ENV
from specdec.speculation import METHODS
from specdec.tls import TlsConfig
from specdec.tree import first_child_chain, is_chain
from verifier.drafter_client import LIVENESS_S, DrafterClient, TargetInfo
from verifier.drafting import DrafterPool
from verifier.engine.proposer import Outcome
from verifier.engine.sequence import Request
from verifier.engine.speculation import Row, SpeculationController, ready_row
from verifier.vllm.policy import RequestPolicy

log = logging.getLogger(__name__)

CONFIG_KEY = "specdec"  # this proposer's section of vLLM's --additional-config
# With log_steps, a line a step: the rows it drafted for, the drafts handed to vLLM, the
# milliseconds propose took (all of it on the step's critical path: vLLM schedules the
# next step once it returns) and of them the wait on the drafters (sending the step's
# outcomes, taking tables and bets, collecting the answers of those asked).
STEP_LOG_FORMAT = "specdec propose: %d rows, %d drafts, %.3f ms, draft wait %.3f ms"


@dataclass(frozen=True, slots=True)
class ProposerConfig:
    """The proposer's settings, from `--additional-config '{"specdec": {...}}'`."""

    # name -> HOST:PORT, in order: the first drafter's method is the default one.
    drafters: dict[str, str] = field(default_factory=dict)
    draft_deadline_ms: float = 100.0
    # K for requests that name none; 0 = the speculative config's num_speculative_tokens.
    num_speculative_tokens: int = 0
    drafter_liveness_s: float = LIVENESS_S
    draft_bets: bool = True  # take the drafters' bets on outcomes (DraftBet)
    # Each step's K of dynamic-K requests chosen here (verifier/engine/speculation.py);
    # requests that name no K are dynamic, within it.
    speculation_controller: bool = False
    # Steps after which the runner holds more requests than this draft nothing.
    disable_queue_size: int | None = None
    # One log line a step with the time propose took and its wait for the drafters
    # (STEP_LOG_FORMAT), for the per-step breakdown bench.serving prints.
    log_steps: bool = False

    def __post_init__(self) -> None:
        for name, address in self.drafters.items():
            if not name or ":" not in address:
                raise ValueError(f"{CONFIG_KEY}.drafters: want NAME: HOST:PORT, got "
                                 f"{name!r}: {address!r}")
        if not self.draft_deadline_ms > 0:
            raise ValueError(f"{CONFIG_KEY}.draft_deadline_ms must be > 0, "
                             f"got {self.draft_deadline_ms}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"{CONFIG_KEY}.num_speculative_tokens must be >= 0, "
                             f"got {self.num_speculative_tokens}")
        if self.disable_queue_size is not None and self.disable_queue_size < 0:
            raise ValueError(f"{CONFIG_KEY}.disable_queue_size must be >= 0, "
                             f"got {self.disable_queue_size}")

    @classmethod
    def from_additional_config(cls, additional: Mapping[str, Any] | None) -> ProposerConfig:
        section = dict((additional or {}).get(CONFIG_KEY) or {})
        unknown = set(section) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{CONFIG_KEY}: unknown settings {sorted(unknown)}")
        return cls(**section)

    def to_additional_config(self) -> dict[str, Any]:
        return {CONFIG_KEY: {"drafters": dict(self.drafters),
                             "draft_deadline_ms": self.draft_deadline_ms,
                             "num_speculative_tokens": self.num_speculative_tokens,
                             "drafter_liveness_s": self.drafter_liveness_s,
                             "draft_bets": self.draft_bets,
                             "speculation_controller": self.speculation_controller,
                             "disable_queue_size": self.disable_queue_size,
                             "log_steps": self.log_steps}}


@dataclass(slots=True)
class _Tracked:
    """A request of the runner's, as its drafter knows it."""

    policy: RequestPolicy
    drafter: str | None  # None: no drafter (method none, or none configured for it)
    seq_id: int = -1  # its sequence on the drafter stream
    num_tokens: int = 0  # context length the drafter has
    num_drafted: int = 0  # drafts handed to vLLM last step
    num_wanted: int = 0  # drafts asked of its drafter last step
    auto_k: bool = False  # the controller chooses its K each step, within its K

    @property
    def key(self) -> str | None:
        return self.policy.request_id


def _step_logger() -> logging.Logger:
    """The logger of the step lines: INFO to stderr whatever the process's logging
    configuration (vLLM's configures its own loggers only)."""
    step_log = logging.getLogger(f"{__name__}.steps")
    if not step_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        step_log.addHandler(handler)
    step_log.setLevel(logging.INFO)
    step_log.propagate = False
    return step_log


def _building_runner() -> Any:
    """The vLLM model runner whose constructor is building the proposer (see the module's
    docstring for why the proposer finds it this way)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, GPUModelRunner):
            return owner
        frame = frame.f_back
    raise RuntimeError("RemoteProposer must be built by vLLM's model runner (speculative "
                       "method custom_class); found none on the stack")


class RemoteProposer:
    def __init__(self, vllm_config: Any):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.runner = _building_runner()
        self.config = ProposerConfig.from_additional_config(vllm_config.additional_config)
        self.max_num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.default_num_speculative_tokens = min(
            self.config.num_speculative_tokens or self.max_num_speculative_tokens,
            self.max_num_speculative_tokens)
        self.max_model_len = vllm_config.model_config.max_model_len
        # Every tensor-parallel rank builds one, but the scheduler takes the drafts of
        # the first rank only: the others hold no drafter streams and propose nothing.
        self.drafting = get_tensor_model_parallel_rank() == 0
        target = target_info(vllm_config.model_config)
        # The verifier's environment reaches the engine's processes: the same internal
        # token and TLS settings as our engine's drafter links.
        token = os.environ.get(INTERNAL_TOKEN_ENV) or None
        tls = TlsConfig.from_env()
        clients = [DrafterClient(name, address, target, token=token, tls=tls,
                                 liveness_s=self.config.drafter_liveness_s,
                                 use_bets=self.config.draft_bets)
                   for name, address in self.config.drafters.items()] if self.drafting else []
        self.pool = DrafterPool(clients, self.max_num_speculative_tokens,
                                self.config.draft_deadline_ms)
        self._tracked: dict[str, _Tracked] = {}  # vLLM's request id -> its drafter state
        self._k: dict[str, int] = {}  # policy key -> K set since the request started
        self._next_seq_id = 0
        self._failures = 0
        self.controller = SpeculationController() if self.config.speculation_controller else None
        # The step now running as the controller chose it, when its drafts were handed
        # over (perf_counter), and the wait for them (ms); its time is measured at the
        # next call, which is where it ends.
        self._rows: list[Row] = []
        self._handed_at: float | None = None
        self._wait_ms = 0.0
        self._step_log = _step_logger() if self.config.log_steps else None

    def load_model(self, model: Any) -> None:
        """vLLM's hook once the target is loaded: connect to the drafters."""
        self.pool.start_all()

    # -- vLLM's step -----------------------------------------------------------------

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        """sampled_token_ids: [num_reqs] this step's tokens per batch row (accepted drafts
        + the sampled one; [] for a partial prefill chunk); num_tokens_no_spec:
        [max_num_reqs] tokens (prompt + output) per row; token_ids_cpu: [max_num_reqs,
        max_model_len] the rows' tokens. Returns [num_reqs] drafts, [] where none."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not self.drafting:
            return drafts
        try:
            self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, drafts)
        except Exception:  # a bug here must cost drafts, never the engine
            self._failures += 1
            if self._failures <= 3:
                log.exception("RemoteProposer failed; this step runs without drafts")
            drafts[:] = [[] for _ in sampled_token_ids]
        return drafts

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                 drafts: list[list[int]]) -> None:
        started = time.perf_counter()
        requests = self.runner.requests
        for req_id in [r for r in self._tracked if r not in requests]:  # finished, aborted
            self._forget(req_id)
        bounds: dict[int, int] = {}  # seq_id -> K it may have next step
        rows: dict[int, tuple[int, _Tracked]] = {}
        outcomes: dict[int, tuple[int, int]] = {}  # seq_id -> (drafted, accepted) this step
        fed, prefill = 0, False  # rows this step fed the target; whether it prefilled
        plain: list[Row] = []  # next step's rows that draft nothing in any case
        for row, (req_id, sampled) in enumerate(zip(self.runner.input_batch.req_ids,
                                                    sampled_token_ids, strict=True)):
            state = requests.get(req_id)
            if not sampled or state is None or state.sampling_params is None:
                prefill = True  # a partial prefill chunk (or a pooling request)
                plain.append(Row(-2 - row, 0, prefill=True))  # it goes on next step
                continue
            num_tokens = int(num_tokens_no_spec[row])
            seq = self._tracked.get(req_id)
            fed += 1 + (seq.num_drafted if seq is not None else 0)
            if seq is None:
                prefill = True  # its prompt was this step's
                seq = self._tracked[req_id] = self._track(req_id, state.sampling_params)
                if seq.drafter is not None:
                    self._start(req_id, seq, token_ids_cpu[row, :num_tokens])
            elif seq.drafter is not None:
                if seq.num_tokens + len(sampled) == num_tokens:
                    num_accepted = len(sampled) - 1
                    self.pool.advance(seq.seq_id, Outcome(
                        num_drafted=max(seq.num_drafted, num_accepted),
                        num_accepted=num_accepted, new_token_ids=[int(t) for t in sampled]))
                    if seq.num_wanted:
                        outcomes[seq.seq_id] = (seq.num_drafted, num_accepted)
                    seq.num_tokens = num_tokens
                else:  # its context changed otherwise (re-prefilled after a preemption)
                    prefill = True
                    self.pool.free(seq.seq_id)
                    self._start(req_id, seq, token_ids_cpu[row, :num_tokens])
                seq.num_drafted = seq.num_wanted = 0
            if seq.drafter is None:  # drafts nothing, new or known
                plain.append(Row(-2 - row, 0))
                continue
            k = self._k.get(seq.key) if seq.key is not None else None
            if k is None:
                k = seq.policy.num_speculative_tokens
            if k is None:
                k = self.default_num_speculative_tokens
            # Every draft is a position of the context: stay under the model's length.
            bounds[seq.seq_id] = max(0, min(k, self.max_num_speculative_tokens,
                                            self.max_model_len - num_tokens - 1))
            rows[seq.seq_id] = row, seq
        wanted = self._choose(bounds, rows, plain, outcomes, fed, prefill, started)
        for seq_id, k in wanted.items():
            rows[seq_id][1].num_wanted = k
        # Sent even when nothing is wanted: the step's outcomes and frees go out with it.
        asking = time.perf_counter()
        proposals = self.pool.propose(wanted, {})
        answered = time.perf_counter()
        for seq_id, proposal in proposals.items():
            row, seq = rows[seq_id]
            ids = proposal.token_ids
            if proposal.parents is not None and not is_chain(proposal.parents):
                ids = [ids[i] for i in first_child_chain(proposal.parents)]
            drafts[row] = ids[:wanted[seq_id]]
            seq.num_drafted = len(drafts[row])
        self._handed_at = time.perf_counter()
        self._wait_ms = (self._handed_at - started) * 1e3
        if self._step_log is not None:
            self._step_log.info(STEP_LOG_FORMAT, len(rows), sum(map(len, drafts)),
                                self._wait_ms, (answered - asking) * 1e3)

    def _choose(self, bounds: dict[int, int], rows: dict[int, tuple[int, _Tracked]],
                plain: list[Row], outcomes: dict[int, tuple[int, int]], fed: int,
                prefill: bool, started: float) -> dict[int, int]:
        """seq_id -> K of the next step: none while the runner holds more requests than
        the queue size, dynamic K's from the controller (which learns of the step that
        has just ended first), the others their bound."""
        limit = self.config.disable_queue_size
        if limit is not None and len(self.runner.requests) > limit:
            bounds = dict.fromkeys(bounds, 0)
        if self.controller is None:
            return {seq_id: k for seq_id, k in bounds.items() if k > 0}
        if self._handed_at is not None:
            # This step ran from the last drafts handed over to now; it waited for them
            # before it started. A step this call cannot see whole (a prompt's) is not
            # priced.
            ended = self._rows + ([Row(-1, 0, prefill=True)] if prefill else [])
            self.controller.observe(ended, outcomes, (started - self._handed_at) * 1e3,
                                    self._wait_ms, fed)
        drafting = [ready_row(seq_id, k, rows[seq_id][1].drafter if rows[seq_id][1].auto_k
                              else None, self.pool)
                    for seq_id, k in bounds.items()]
        self._rows = plain + drafting
        chosen = self.controller.choose(self._rows)
        # A row not chosen for keeps its bound: a fixed K, or none (0, a table said so).
        ks = {row.key: chosen.get(row.key, row.bound) for row in drafting}
        return {seq_id: k for seq_id, k in ks.items() if k > 0}

    def _track(self, req_id: str, sampling_params: Any) -> _Tracked:
        try:
            policy = RequestPolicy.from_extra_args(sampling_params.extra_args)
        except ValueError as e:
            log.warning("request %s runs without drafts: %s", req_id, e)
            return _Tracked(RequestPolicy(method="none"), None)
        if policy.method == "none":
            return _Tracked(policy, None)
        try:
            value = METHODS[policy.method] if policy.method else self.pool.default_method()
            client = self.pool.resolve(value, policy.drafter or "")
        except ValueError as e:
            log.warning("request %s runs without drafts: %s", req_id, e)
            client = None
        if client is not None and client.hidden_layers():
            client = None  # EAGLE heads read the target's hidden states, which vLLM keeps
        auto = policy.auto_k
        if auto is None:  # a request naming no K follows the controller, where there is one
            auto = self.controller is not None and policy.num_speculative_tokens is None
        return _Tracked(policy, client.name if client is not None else None,
                        auto_k=auto and self.controller is not None)

    def _start(self, req_id: str, seq: _Tracked, context: Any) -> None:
        tokens = [int(t) for t in context]
        seq.seq_id = self._next_seq_id
        self._next_seq_id += 1
        seq.num_tokens = len(tokens)
        self.pool.start(seq.seq_id, Request(
            request_id=req_id, prompt_token_ids=tokens,
            max_tokens=max(self.max_model_len - len(tokens), 1),
            sampling=SamplingParams(temperature=0.0), drafter=seq.drafter,
            cache_salt=seq.policy.cache_salt or ""))

    def _forget(self, req_id: str) -> None:
        seq = self._tracked.pop(req_id)
        if seq.drafter is not None:
            self.pool.free(seq.seq_id)
        if self.controller is not None:
            self.controller.forget(seq.seq_id)
        if seq.key is not None:
            self._k.pop(seq.key, None)

    # -- the verifier service's controls (verifier/vllm/worker.py) ----------------------

    def set_num_speculative_tokens(self, updates: Mapping[str, int]) -> None:
        """K from the next step on for requests named by their policy key (K = 0:
        tracked, no drafts), as the gateway's policy updates set it."""
        self._k.update(updates)

    def drafters(self) -> list[dict[str, Any]]:
        """The configured drafters as LoadReport.drafters lists them."""
        # A drafter that reads the target's hidden states (EAGLE) cannot draft here:
        # vLLM hands a custom proposer none.
        return [{"name": c.name, "method": c.method,
                 "available": c.available and not c.hidden_layers(),
                 "max_num_speculative_tokens": min(c.max_num_speculative_tokens,
                                                   self.max_num_speculative_tokens),
                 "bet_lookups": c.bet_lookups, "bet_hits": c.bet_hits}
                for c in self.pool.clients.values()]

    def close(self) -> None:
        self.pool.close()


def target_info(model_config: Any) -> TargetInfo:
    """What the drafters must agree with; the tokenizer's hash when the model is a local
    directory (a hub name gives "", which compares the vocabulary size alone)."""
    from specdec.tokenizer import model_fingerprint

    hf = model_config.hf_text_config
    digest = ""
    if os.path.isdir(model_config.model):
        try:
            _, digest = model_fingerprint(model_config.model)
        except Exception as e:  # an unusual layout: the vocabulary size still guards
            log.warning("no tokenizer fingerprint for %s: %s", model_config.model, e)
    return TargetInfo(hf.vocab_size, digest, hf.hidden_size, hf.num_hidden_layers)
