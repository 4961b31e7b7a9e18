"""The verifier's end of one drafter's `Drafter.Draft` stream.

One long-lived stream per drafter carries one DraftRequest per verifier
step for the whole batch. The engine thread calls `send` (the step's
entries: starts, outcomes, frees, and the K wanted) and `collect` (the
proposals, waiting no longer than the draft deadline). A connection thread
owns the stream: it checks Info against the target, reads responses, and
when the drafter is unreachable or the stream breaks, marks the drafter
down (its sequences run with K = 0), reconnects with exponential backoff
and re-starts every live sequence from its prompt and the tokens so far.

A sequence at K = 0 (its speculation off, by dynamic K or the request) is not
sent each step: its outcomes are held, merged into one Advance, and go out with
the next step that asks it for drafts, or once HOLD_HOST_ROWS rows of hidden
states are held in host memory; before it is freed, its tokens alone go to a
drafter without hidden states (a suffix drafter learns from whole replies), and
nothing to one with. A drafter that places tables (DraftTable: ngram, suffix, which take
no hidden states) is sent every step's outcomes instead: a table answers the outcome of
one step, so a sequence held plain for two steps found none when it drafted again and
waited for the answer (under the speculation controller ngram's tables answered 75-93 %
of lookups so, and all of them sent every step). A drafter
needs a sequence's context only to draft for it, and a message a step for every
sequence not drafting made a batch of 16 whose speculation dynamic K had turned
off 13 % slower than plain decoding on two cores (the EAGLE-3 drafter woke each
step to take hidden states it never used, and the verifier encoded them, on the
cores the forward runs on). Held hidden states stay where the target wrote them,
in the KV cache's feature store (Outcome.hidden_kept), and are read when they go
out: copied out a step at a time they still cost such a batch 3 %. Those cost no
memory to hold, and are held however many there are: sent every HOLD_HOST_ROWS, they
had the EAGLE-3 head take in 256 rows for each of 16 sequences while their batch ran
plain, and plain steps at batch 13-16 took 5-8 % longer than in a plain run. A
sequence whose held rows are gone by then (preempted, its KV freed) is re-started
instead.

A drafter that is slower than the deadline is never asked for a new
proposal while its previous one is still outstanding: the step's outcomes
are still sent (K = 0), so it catches up instead of building a backlog.
One that answers nothing for `liveness_s` (a hung process whose connection
is still up), or behind which more than `max_queued` requests pile up
unsent, is cut off: its stream is cancelled, which marks it down and
reconnects it like a broken stream, so its sequences speculate again once it
answers, and the queue of requests (outcomes with hidden states) stays
bounded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry import trace

from specdec import tree as token_tree
from specdec.draft_parts import request_parts
from specdec.draft_table import TableIndex
from specdec.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.sampling import SamplingParams
from specdec.server import (
    DRAFT_PART_BYTES,
    GRPC_DEFAULT_BYTES,
    KEEPALIVE_OPTIONS,
    draft_response_bytes,
    token_metadata,
)
from specdec.telemetry import outgoing_metadata
from specdec.tensor_codec import decode_tensor, dtype_from_proto, encode_tensor
from specdec.tls import TlsConfig, open_channel
from verifier.engine.proposer import FeatureReader, Outcome, Proposal

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("specdec.verifier")

_CLOSE = object()  # ends a request iterator
# A drafter that has not answered a proposal request for this long is hung: far past
# any draft deadline (100 ms by default), and past an EAGLE head's longest prefill.
LIVENESS_S = 10.0
# DraftRequests queued for the stream and not yet taken by gRPC: one per step, so a
# drafter that stops reading falls this far behind before it is cut off.
MAX_QUEUED = 256
# Rows of hidden states of K = 0 steps a sequence holds in host memory (taken out of
# the step's, not left in the feature store) before they are sent all the same: bounds
# that memory per sequence ([HOLD_HOST_ROWS, layers, hidden]: 1.7 MiB for the default
# model in float32). Sent, they cost the drafter work whether or not it drafts again:
# an EAGLE head folds the states of 256 positions into its cache (drafter/eagle.py),
# about 10 MFLOP a position for the default model's head.
HOLD_HOST_ROWS = 256


@dataclass(frozen=True, slots=True)
class TargetInfo:
    """What a drafter must agree with."""

    vocab_size: int
    tokenizer_hash: str  # "" = unknown (tiny test models): compare vocab_size only
    hidden_size: int
    num_layers: int


def check_info(info: drafter_pb2.InfoResponse, target: TargetInfo) -> str | None:
    """Why this drafter cannot serve the target, or None when it can."""
    tok = info.tokenizer
    if tok.vocab_size and tok.vocab_size != target.vocab_size:
        return (f"tokenizer mismatch: drafter vocab_size {tok.vocab_size}, "
                f"target {target.vocab_size}")
    if tok.hash and target.tokenizer_hash and tok.hash != target.tokenizer_hash:
        return (f"tokenizer mismatch: drafter fingerprint {tok.hash[:12]}..., "
                f"target {target.tokenizer_hash[:12]}...")
    if info.needs_hidden_states:
        if info.hidden_size != target.hidden_size:
            return f"hidden_size mismatch: drafter {info.hidden_size}, target {target.hidden_size}"
        bad = [x for x in info.hidden_state_layers if not 0 <= x <= target.num_layers]
        if bad or not info.hidden_state_layers:
            return (f"hidden_state_layers {list(info.hidden_state_layers)} not within "
                    f"0..{target.num_layers}")
        try:
            dtype_from_proto(info.hidden_state_dtype)
        except ValueError as e:
            return f"hidden_state_dtype: {e}"
    return None


@dataclass(slots=True)
class _Seq:
    prompt: list[int]
    sampling: SamplingParams
    max_num_speculative_tokens: int
    tenant: str = ""
    output: list[int] = field(default_factory=list)
    round: int = 0
    generation: int = -1  # stream generation its Start went out on; -1 = not yet
    pending: drafter_pb2.DraftEntry | None = None  # outcome waiting for the next send
    # Its new tokens, as a list: every step's lookup reads them (not from the message).
    pending_tokens: list[int] = field(default_factory=list)
    # Outcomes of K = 0 steps not sent yet (see the module's docstring): their new
    # tokens, and their hidden states, of positions held_start.. in a row, where the
    # drafter wants them: each piece [P_i, layers, hidden], or (start, P_i), rows in
    # the verifier's feature store.
    held_tokens: list[int] = field(default_factory=list)
    held_hidden: list[torch.Tensor | tuple[int, int]] = field(default_factory=list)
    held_start: int = 0
    held_rows: int = 0
    host_rows: int = 0  # of held_rows, those held as tensors
    # The drafter's bets (DraftBet) on the outcome its last proposal will have: the new
    # tokens bet on -> the drafts after them, for the Advance of round bet_round.
    bets: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    bet_round: int = -1
    # Or every outcome's drafts at once (DraftTable), for the same round.
    table: TableIndex | None = None
    # Each token's latest position among the context's first `indexed` (copy_after's).
    latest: dict[int, int] = field(default_factory=dict)
    indexed: int = 0

    def copy_after(self, token: int, k: int) -> list[int]:
        """The (at most k) tokens that followed `token`'s latest occurrence before the
        context's last token, through that last token: what a one-token n-gram match
        drafts (DraftTable.copy_unlisted). Indexes the context as it grows, a slice at
        a time."""
        prompt, output = self.prompt, self.output
        p = len(prompt)
        end = p + len(output) - 1  # positions before the last token are indexed
        stop = min(p, end)
        if self.indexed < stop:
            self.latest.update(zip(prompt[self.indexed:stop], range(self.indexed, stop),
                                   strict=True))
            self.indexed = stop
        if self.indexed < end:  # past the prompt
            self.latest.update(zip(output[self.indexed - p:end - p], range(self.indexed, end),
                                   strict=True))
            self.indexed = end
        j = self.latest.get(token)
        if j is None:
            return []
        lo, hi = j + 1, min(j + 1 + k, end + 1)
        if lo >= p:
            return output[lo - p:hi - p]
        return prompt[lo:hi] + output[:max(0, hi - p)]

    def unsent(self) -> list[int] | None:
        """The tokens the next Advance appends, if it is one a bet can name: a pending
        outcome without rollback, or held outcomes without hidden states."""
        if self.pending is not None:
            return self.pending_tokens  # (the verifier rolls nothing back)
        if self.held_tokens and not self.held_rows:
            return self.held_tokens
        return None

    def hold(self, outcome: Outcome) -> None:
        """Merge a K = 0 step's outcome into those held."""
        self.held_tokens.extend(outcome.new_token_ids)
        hidden = outcome.hidden_states
        rows = outcome.hidden_kept or (hidden.shape[0] if hidden is not None else 0)
        if not rows:
            return
        if self.held_hidden and outcome.hidden_start != self.held_start + self.held_rows:
            # Not the next positions (the target recomputed some): the drafter gets these
            # alone, and its context starts over from them, as when states go missing.
            self.held_hidden, self.held_rows, self.host_rows = [], 0, 0
        if not self.held_hidden:
            self.held_start = outcome.hidden_start
        self.held_rows += rows
        if outcome.hidden_kept:
            last = self.held_hidden[-1] if self.held_hidden else None
            if isinstance(last, tuple):  # the next positions of the same store range
                self.held_hidden[-1] = (last[0], last[1] + rows)
            else:
                self.held_hidden.append((outcome.hidden_start, rows))
            return
        # In host memory, as an encoded Advance was: on a GPU, states held for many
        # sequences would take memory the KV cache was sized without.
        self.held_hidden.append(hidden.to("cpu"))
        self.host_rows += rows

    def held(self) -> int:
        """Tokens or hidden-state rows held, the more of the two (a prefill's chunks
        bring states without tokens)."""
        return max(len(self.held_tokens), self.held_rows)

    def release(self) -> list[int]:
        """The held tokens (the hidden states dropped); nothing held after."""
        tokens = self.held_tokens
        self.held_tokens, self.held_hidden, self.held_rows, self.host_rows = [], [], 0, 0
        return tokens


class DrafterClient:
    def __init__(self, name: str, address: str, target: TargetInfo, *,
                 backoff_s: tuple[float, float] = (0.1, 5.0), rpc_timeout_s: float = 5.0,
                 liveness_s: float = LIVENESS_S, max_queued: int = MAX_QUEUED,
                 token: str | None = None, tls: TlsConfig | None = None,
                 use_bets: bool = True, part_bytes: int = DRAFT_PART_BYTES):
        """part_bytes: the largest message a step's request is packed into
        (DraftRequest.continued; less where the drafter takes less), but an entry that
        cannot be split."""
        self.name = name
        self.address = address
        self.target = target
        self.backoff_s = backoff_s
        self.rpc_timeout_s = rpc_timeout_s
        self.info: drafter_pb2.InfoResponse | None = None
        self.error = "not connected yet"
        self._lock = threading.Condition()
        self._seqs: dict[int, _Seq] = {}
        self._freed: list[int] = []  # sequences to Free on the current stream
        # Their last outcomes, sent before the Frees (a suffix drafter learns from the
        # whole reply when a sequence is freed)
        self._last: list[drafter_pb2.DraftEntry] = []
        self._outq: queue.SimpleQueue | None = None  # requests of the live stream; None = down
        self._generation = 0
        # step -> its answer, whole: the messages it came in (DraftResponse.continued).
        self._responses: dict[int, list[drafter_pb2.DraftResponse]] = {}
        self._outstanding: int | None = None  # step whose proposals have not arrived
        self._outstanding_since = 0.0  # time.monotonic() it was asked
        self._auth = token_metadata(token)  # the drafter's internal token, if it has one
        self._tls = tls
        self.liveness_s = liveness_s
        self.max_queued = max_queued
        self.part_bytes = part_bytes
        self._call = None  # the live Draft stream, to cancel a hung drafter's
        self._cut_reason: str | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"drafter-{name}", daemon=True)
        self.misses: dict[int, str] = {}  # seq_id -> reason, for the last send/collect
        self.draft_time_ms = 0.0  # what the drafter reported for the last collected answer
        # The engine's reader of held rows in its feature store (DrafterPool binds it).
        self.read_features: FeatureReader | None = None
        # Bets (DraftBet, docs/design.md section 2): a sequence whose outcome the drafter
        # bet on right gets the bet's drafts at once, without waiting for its answer.
        self.use_bets = use_bets
        self._betting = False  # the drafter has placed a bet on this client
        self._tabling = False  # ... or a table: it is sent every step's outcomes
        self.bet_lookups = 0  # sequences asked for drafts with an outcome a bet could name
        self.bet_hits = 0  # of those, answered by a bet or table
        # This step's, from send() to collect(): a bet or table's drafts, or an empty
        # proposal where a table says there are none (answered all the same).
        self._hits: dict[int, Proposal] = {}
        self._unwaited: int | None = None  # a step asked whose answer nobody waited for
        self._bets_due: int | None = None  # a step answered whose bets have not arrived

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> DrafterClient:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._outq is not None:
                self._outq.put(_CLOSE)
            self._lock.notify_all()
        self._thread.join(timeout=5)

    @property
    def available(self) -> bool:
        return self._outq is not None

    @property
    def method(self) -> int:
        return self.info.method if self.info is not None else common_pb2.SPEC_METHOD_UNSPECIFIED

    @property
    def max_num_speculative_tokens(self) -> int:
        return self.info.max_num_speculative_tokens if self.info is not None else 0

    def hidden_layers(self) -> tuple[int, ...]:
        if self.info is None or not self.info.needs_hidden_states:
            return ()
        return tuple(self.info.hidden_state_layers)

    def wait_available(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self.available and time.monotonic() < deadline:
                self._lock.wait(timeout=deadline - time.monotonic())
            return self.available

    # -- engine thread -----------------------------------------------------------

    def track(
        self,
        seq_id: int,
        prompt: list[int],
        sampling: SamplingParams,
        max_num_speculative_tokens: int,
        tenant: str = "",
    ) -> None:
        """tenant: the request's cache_salt (DraftEntry.Start.tenant)."""
        with self._lock:
            self._seqs[seq_id] = _Seq(list(prompt), sampling, max_num_speculative_tokens,
                                      tenant=tenant)

    def record(self, seq_id: int, outcome: Outcome) -> None:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return
            seq.output.extend(outcome.new_token_ids)
            if seq.generation != self._generation or seq.pending is not None or \
                    (outcome.num_drafted and seq.held()):
                # Not started on this stream, or an outcome is still unsent (a
                # skipped send): the next send re-starts it from the mirror.
                seq.generation = -1
                seq.pending = None
                seq.release()
                return
            if not outcome.num_drafted:
                seq.hold(outcome)  # sent when it is asked for drafts (send())
                return
            seq.pending = drafter_pb2.DraftEntry(seq_id=seq_id, advance=self._advance(
                outcome.num_drafted, outcome.num_accepted, outcome.new_token_ids,
                outcome.hidden_states, outcome.hidden_start))
            seq.pending_tokens = list(outcome.new_token_ids)

    def _advance(self, num_drafted: int, num_accepted: int, new_token_ids: list[int],
                 hidden_states: torch.Tensor | None,
                 hidden_start: int) -> drafter_pb2.DraftEntry.Advance:
        adv = drafter_pb2.DraftEntry.Advance(
            num_drafted=num_drafted, num_accepted=num_accepted, new_token_ids=new_token_ids)
        if hidden_states is not None and self.info is not None:
            dtype = dtype_from_proto(self.info.hidden_state_dtype)
            adv.hidden_states.tensor.CopyFrom(encode_tensor(hidden_states.to(dtype)))
            adv.hidden_states.layers.extend(self.info.hidden_state_layers)
            adv.hidden_states.start_position = hidden_start
        return adv

    def _held_entries(self, seq_id: int, seq: _Seq) -> list[drafter_pb2.DraftEntry] | None:
        """The sequence's held outcomes as one Advance, or as Advances of consecutive
        rows where its hidden states exceed a message (nothing held after); None, with
        everything still held, where rows held in the feature store are gone."""
        pieces = []
        for piece in seq.held_hidden:
            if isinstance(piece, tuple):
                start, num = piece
                rows = self.read_features(seq_id, start, num)  # [num, L * hidden]
                if rows is None:
                    return None
                piece = rows.view(num, len(self.hidden_layers()), -1).to("cpu")
            pieces.append(piece)
        hidden = torch.cat(pieces) if pieces else None  # [R, layers, hidden]
        start = seq.held_start
        # The context's length before the held tokens: token i is at position before + i.
        before = len(seq.prompt) + len(seq.output) - len(seq.held_tokens)
        tokens = seq.release()
        if hidden is None:
            return [drafter_pb2.DraftEntry(seq_id=seq_id,
                                           advance=self._advance(0, 0, tokens, None, 0))]
        itemsize = dtype_from_proto(self.info.hidden_state_dtype).itemsize
        # Rows a message takes, each with its token (at most 5 bytes) and some room to spare.
        per_part = max(1, (self._budget() - 256) // (hidden[0].numel() * itemsize + 5))
        entries, sent = [], 0
        for a in range(0, hidden.shape[0], per_part):
            b = min(a + per_part, hidden.shape[0])
            # The drafter takes a row only with its position's token in the context: a
            # part carries the tokens through its last row's position (all, the last).
            upto = len(tokens) if b == hidden.shape[0] else min(len(tokens),
                                                                max(sent, start + b - before))
            entries.append(drafter_pb2.DraftEntry(seq_id=seq_id, advance=self._advance(
                0, 0, tokens[sent:upto], hidden[a:b], start + a)))
            sent = upto
        return entries

    def forget(self, seq_id: int) -> None:
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None and seq.generation == self._generation:
                last = seq.pending
                if seq.held_tokens and not self.hidden_layers():
                    # Its tokens, for a drafter that learns from whole replies (suffix).
                    # One that drafts from hidden states has no use for them now, and
                    # refuses new tokens without their states: such an Advance ended its
                    # stream, and every live sequence's head context with it.
                    last = drafter_pb2.DraftEntry(seq_id=seq_id, advance=self._advance(
                        0, 0, seq.release(), None, 0))
                if last is not None:
                    seq.round += 1
                    last.round = seq.round
                    self._last.append(last)
                self._freed.append(seq_id)

    def send(self, step: int, wanted: dict[int, int], deadline: float | None = None) -> bool:
        """Send the step's request. Returns whether a response with proposals is due, to
        wait for in `collect`: not when every sequence asked was answered by a bet.
        deadline (time.monotonic()): how long to wait for the answer of a step that took
        only bets, before asking again (None: do not wait)."""
        self.misses = {}
        self._hits = {}
        with self._lock:
            self._responses = {s: r for s, r in self._responses.items() if s >= step}
            outq = self._outq
            if outq is None:
                for seq in self._seqs.values():
                    seq.pending = None
                    seq.bets = {}
                    seq.release()
                self._freed.clear()
                self._last.clear()
                self.misses = dict.fromkeys(wanted, "drafter_unavailable")
                return False
            hung = self._hung(outq)
            if hung is not None:
                self._cut(hung)
                self.misses = dict.fromkeys(wanted, "drafter_unavailable")
                return False
            looking = self.use_bets and any(wanted.get(s) and seq.unsent() is not None
                                            for s, seq in self._seqs.items())

            def settled() -> bool:
                if self._outq is not outq or not any(wanted.values()):
                    return True  # down, or a step that drafts nothing has nothing to wait for
                if self._outstanding is not None and self._outstanding == self._unwaited:
                    return False  # the last step took bets alone; its answer brings more
                return self._bets_due is None or not looking  # bets said to follow

            self._wait(settled, deadline)
            asked = wanted
            if self._outstanding is not None:
                # Still waiting for an older answer: outcomes only, no new proposals.
                self.misses = dict.fromkeys(wanted, "deadline")
                asked = {}
            entries = self._last + [
                drafter_pb2.DraftEntry(seq_id=s, free=drafter_pb2.DraftEntry.Free())
                for s in self._freed]
            self._freed.clear()
            self._last = []
            for seq_id, seq in self._seqs.items():
                k = min(wanted.get(seq_id, 0), seq.max_num_speculative_tokens)
                bet = self._bet(seq, k)
                if bet is not None:
                    self._hits[seq_id] = Proposal(bet[:k])
                    self.misses.pop(seq_id, None)
                seq.bets, seq.table = {}, None
                k = min(asked.get(seq_id, 0), seq.max_num_speculative_tokens)
                goes = (seq.pending is not None or k or seq.host_rows >= HOLD_HOST_ROWS
                        or self._tabling)
                advances = None
                if seq.generation == self._generation and goes and seq.held():
                    advances = self._held_entries(seq_id, seq)
                    if advances is None:  # its held states are gone: re-started below
                        seq.generation, seq.pending = -1, None
                if seq.generation != self._generation:
                    entries.append(
                        drafter_pb2.DraftEntry(
                            seq_id=seq_id,
                            round=seq.round,
                            start=drafter_pb2.DraftEntry.Start(
                                prompt_token_ids=seq.prompt,
                                sampling=seq.sampling.to_proto(),
                                max_num_speculative_tokens=seq.max_num_speculative_tokens,
                                output_token_ids=seq.output,
                                num_speculative_tokens=k,
                                tenant=seq.tenant,
                            ),
                        )
                    )
                    seq.generation = self._generation
                    seq.release()  # the Start carries the tokens
                elif goes:
                    if advances is None:
                        advances = [seq.pending or drafter_pb2.DraftEntry(
                            seq_id=seq_id, advance=drafter_pb2.DraftEntry.Advance())]
                    for entry in advances:  # a round each
                        seq.round += 1
                        entry.round = seq.round
                    advances[-1].advance.num_speculative_tokens = k
                    entries.extend(advances)
                seq.pending = None
            if not entries:
                return False
            # Sequences a bet answered are asked all the same: the answer carries the
            # bets on the drafts they verify now.
            if any(asked.values()):
                self._outstanding = step
                self._outstanding_since = time.monotonic()
            due = any(k for seq_id, k in asked.items() if seq_id not in self._hits)
            self._unwaited = None if due or self._outstanding != step else step
            request = drafter_pb2.DraftRequest(step=step, entries=entries)
            budget = self._budget()
            if request.ByteSize() <= budget:  # the usual step: one message, sized once
                outq.put(request)
                return due
            self._drop_oversize(request)
            for part in request_parts(request, budget):
                outq.put(part)
            return due

    def _max_request_bytes(self) -> int:
        """The largest message the drafter takes (InfoResponse.max_request_bytes)."""
        return (self.info.max_request_bytes if self.info is not None else 0) or GRPC_DEFAULT_BYTES

    def _budget(self) -> int:
        """The largest message a step's request is packed into."""
        return min(self.part_bytes, self._max_request_bytes())

    def _drop_oversize(self, request: drafter_pb2.DraftRequest) -> None:
        """Replace each entry larger than the drafter takes (a Start of a context past
        what it drafts for, in practice) with a Free: that sequence runs without this
        drafter from now on. Under the lock."""
        limit = self._max_request_bytes()
        for entry in request.entries:
            size = entry.ByteSize()
            if size + 32 <= limit:  # with the message around it
                continue
            log.warning("drafter %s takes messages of at most %d bytes; sequence %d's %s "
                        "is %d: it runs without this drafter", self.name, limit,
                        entry.seq_id, entry.WhichOneof("kind"), size)
            self._seqs.pop(entry.seq_id, None)
            self._hits.pop(entry.seq_id, None)
            entry.CopyFrom(drafter_pb2.DraftEntry(seq_id=entry.seq_id,
                                                  free=drafter_pb2.DraftEntry.Free()))

    def ready_drafts(self, seq_id: int) -> int | None:
        """How many drafts the next send will find for the sequence's outcome in a bet or
        table (0: a table says none), or None where it must wait for the drafter (a bet
        or table that arrives before then may answer after all)."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            if (seq is None or not self.use_bets or self._outq is None
                    or seq.generation != self._generation):
                return None
            drafts = self._bet_for(seq, seq.unsent())
            return None if drafts is None else len(drafts)

    def _bet_for(self, seq: _Seq, new: list[int] | None) -> list[int] | None:
        """The drafts a bet or table placed for the outcome `new` the sequence's next
        Advance carries (seq.unsent()): [] where a table says none, None where no bet
        names it. Under the lock."""
        if new is None or seq.bet_round != seq.round + 1:
            return None
        if seq.table is not None:
            return seq.table.lookup(new, seq.copy_after)
        return seq.bets.get(tuple(new)) or None

    def _bet(self, seq: _Seq, k: int) -> list[int] | None:
        """The drafts a bet or table placed for the outcome the sequence's next Advance
        carries, counted as a lookup, or None. Under the lock."""
        new = seq.unsent() if k and seq.generation == self._generation else None
        if new is None:
            return None
        if not self._betting:
            return None  # a drafter that places no bets has no lookups to count
        self.bet_lookups += 1
        bet = self._bet_for(seq, new) if self.use_bets else None
        if bet is not None:
            self.bet_hits += 1
        return bet

    def _wait(self, done, deadline: float | None) -> None:
        """Wait on the lock's condition until done() or the deadline. Under the lock."""
        while deadline is not None and not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._lock.wait(timeout=left)

    def _take_bets(self, resp: drafter_pb2.DraftResponse, tables: list[TableIndex]) -> None:
        """Keep a followup's bets on the sequences' next outcomes, and its tables
        (`tables`: resp.tables indexed). Under the lock."""
        self._betting = True
        for bet in resp.bets:
            seq = self._seqs.get(bet.seq_id)
            if seq is None or bet.round != seq.round + 1:
                continue  # freed, or its next Advance has gone out already
            if seq.bet_round != bet.round:
                seq.bets, seq.table, seq.bet_round = {}, None, bet.round
            seq.bets[tuple(bet.new_token_ids)] = list(bet.token_ids)
        self._tabling = self._tabling or bool(resp.tables)
        for table, index in zip(resp.tables, tables, strict=True):
            seq = self._seqs.get(table.seq_id)
            if seq is None or table.round != seq.round + 1:
                continue
            seq.bets, seq.table, seq.bet_round = {}, index, table.round

    def _hung(self, outq: queue.SimpleQueue) -> str | None:
        """Why the live stream's drafter counts as hung, or None. Under the lock."""
        if (self._outstanding is not None
                and time.monotonic() - self._outstanding_since > self.liveness_s):
            return f"no answer for {self.liveness_s:g} s"
        if outq.qsize() > self.max_queued:
            return f"{outq.qsize()} requests queued unsent"
        return None

    def _cut(self, reason: str) -> None:
        """Cancel the live stream (under the lock): the connection thread marks the drafter
        down and reconnects, and every live sequence re-starts on the new stream."""
        if self._call is None or self._cut_reason is not None:
            return
        self._cut_reason = reason
        log.warning("drafter %s at %s is hung (%s); cutting it off", self.name, self.address,
                    reason)
        self._call.cancel()

    def collect(self, step: int, deadline: float, wanted: dict[int, int],
                due: bool = True) -> dict[int, Proposal]:
        """Proposals for `step`: the bets `send` found, and unless none is due the answer,
        waited for until `deadline` (time.monotonic())."""
        answered, self._hits = self._hits, {}
        hits = {s: p for s, p in answered.items() if p.token_ids}
        if not due:
            self.draft_time_ms = 0.0
            return hits
        with self._lock:
            generation = self._generation
            self._wait(lambda: (step in self._responses or self._generation != generation
                                or self._outq is None), deadline)
            parts = self._responses.pop(step, None)
            if parts is None:
                self.draft_time_ms = 0.0
                reason = "deadline" if self._outq is not None else "drafter_unavailable"
                self.misses.update({s: reason for s in wanted if s not in answered})
                return hits
            self.draft_time_ms = parts[-1].draft_time_ms
            for seq_id in parts[-1].unknown_seq_ids:
                if seq_id in self._seqs:
                    self._seqs[seq_id].generation = -1  # re-start it next step
            rounds = {s: seq.round for s, seq in self._seqs.items()}
        out: dict[int, Proposal] = dict(hits)
        for prop in (p for part in parts for p in part.proposals):
            if prop.seq_id not in wanted or prop.seq_id in answered:
                continue
            if rounds.get(prop.seq_id) != prop.round:
                # Drafted for a context the sequence has already left: as good as late.
                self.misses[prop.seq_id] = "deadline"
                continue
            parents = None
            if prop.parents:
                parents = list(prop.parents)
                try:
                    token_tree.check_parents(parents, len(prop.token_ids), "parents")
                except ValueError as e:
                    log.warning("drafter %s sent an unusable token tree: %s", self.name, e)
                    continue  # the sequence runs with K = 0 this step
            out[prop.seq_id] = Proposal(list(prop.token_ids), self._probs(prop), parents)
        # A sequence the drafter answered for without a proposal had nothing to draft
        # (no n-gram match, say): the step did not miss anything, so no reason is set.
        return out

    def _probs(self, prop: drafter_pb2.DraftProposal) -> torch.Tensor | None:
        """[k, V] float32 q, or a zero-row tensor (which the engine refuses, so the
        sequence runs with K = 0) when the drafter sent something unusable."""
        kind = prop.probs.WhichOneof("layout")
        k, vocab = len(prop.token_ids), self.target.vocab_size
        try:
            if kind == "dense":
                return decode_tensor(prop.probs.dense, expected_shape=(k, vocab)).float()
            if kind == "sparse":
                sp = prop.probs.sparse
                lengths = list(sp.row_lengths)
                if len(lengths) != k or sum(lengths) != len(sp.token_ids) or len(sp.probs) != len(sp.token_ids):
                    raise ValueError("sparse probs do not line up with token_ids")
                q = torch.zeros(k, vocab)
                rows = torch.repeat_interleave(torch.arange(k), torch.tensor(lengths, dtype=torch.int64))
                cols = torch.tensor(list(sp.token_ids), dtype=torch.int64)
                if cols.numel() and (cols.min() < 0 or cols.max() >= vocab):
                    raise ValueError("sparse probs name tokens outside the vocabulary")
                q[rows, cols] = torch.tensor(list(sp.probs))
                return q
        except ValueError as e:
            log.warning("drafter %s sent unusable probabilities: %s", self.name, e)
            return torch.zeros(0, vocab)
        return None

    # -- connection thread ---------------------------------------------------------

    def _run(self) -> None:
        delay = self.backoff_s[0]
        while not self._closed.is_set():
            channel = open_channel(self.address, self._tls, KEEPALIVE_OPTIONS)
            outq: queue.SimpleQueue = queue.SimpleQueue()
            try:
                info = drafter_pb2_grpc.DrafterStub(channel).Info(
                    drafter_pb2.InfoRequest(), timeout=self.rpc_timeout_s, metadata=self._auth)
                problem = check_info(info, self.target)
                if problem is not None:
                    self.error = problem
                    log.error("drafter %s at %s refused: %s", self.name, self.address, problem)
                    self.info = None
                else:
                    self.info = info
                    # The stream's own channel takes answers of the size this drafter's
                    # proposals can have (a part, or one with dense q at its largest K).
                    channel.close()
                    channel = open_channel(self.address, self._tls, [
                        *KEEPALIVE_OPTIONS,
                        ("grpc.max_receive_message_length", draft_response_bytes(
                            info.max_num_speculative_tokens, self.target.vocab_size))])
                    stub = drafter_pb2_grpc.DrafterStub(channel)
                    # The stream's span parents the drafter's; it lasts as long as the stream.
                    span = _tracer.start_span("verifier.draft_stream",
                                              attributes={"specdec.drafter": self.name,
                                                          "specdec.address": self.address})
                    with trace.use_span(span, end_on_exit=True):
                        responses = stub.Draft(iter(outq.get, _CLOSE),
                                               metadata=(*outgoing_metadata(), *self._auth))
                        with self._lock:
                            self._call = responses
                            self._cut_reason = None
                            self._outq = outq
                            self._generation += 1  # every live sequence re-starts on this stream
                            self._outstanding = self._unwaited = self._bets_due = None
                            self._freed.clear()
                            self._last.clear()
                            self._lock.notify_all()
                        self.error = ""
                        log.info("drafter %s connected at %s", self.name, self.address)
                        delay = self.backoff_s[0]
                        parts: list[drafter_pb2.DraftResponse] = []  # of an answer
                        for resp in responses:
                            # Indexed here, before the lock: in the shadow of the step.
                            tables = [TableIndex(t) for t in resp.tables]
                            with self._lock:
                                if resp.followup:
                                    self._take_bets(resp, tables)
                                    if (self._bets_due is not None and not resp.continued
                                            and resp.step >= self._bets_due):
                                        self._bets_due = None
                                    self._lock.notify_all()
                                    continue
                                parts.append(resp)
                                if resp.continued:
                                    continue
                                self._responses[resp.step], parts = parts, []
                                if resp.bets_follow:
                                    self._bets_due = resp.step
                                if self._outstanding is not None and resp.step >= self._outstanding:
                                    self._outstanding = None
                                self._lock.notify_all()
                        self.error = "stream ended by the drafter"
            except grpc.RpcError as e:
                self.error = f"{e.code().name}: {e.details()}"
            finally:
                with self._lock:
                    if self._cut_reason is not None:
                        self.error = f"cut off: {self._cut_reason}"
                    was_up = self._outq is outq
                    self._outq = None
                    self._outstanding = None
                    self._bets_due = None
                    self._call = None
                    self._lock.notify_all()
                outq.put(_CLOSE)
                channel.close()
            if self._closed.is_set():
                break
            if was_up:
                log.warning("drafter %s stream lost (%s); reconnecting", self.name, self.error)
            self._closed.wait(delay)
            delay = min(delay * 2, self.backoff_s[1])
