"""The Drafter gRPC service: a thin translation of the Draft stream onto one DraftMethod.

Each Draft stream gets a number; the method sees sequence keys
(stream number, seq_id), so two verifiers' sequence ids never meet, and a
stream that ends, however it ends, frees every key it held. The servicer
checks each sequence's round (Start sets it, each Advance is the previous
round + 1) and reports sequences it holds no state for in unknown_seq_ids,
so the verifier re-starts them instead of drafting from a stale context.

Method calls are synchronous (torch on CPU or GPU), so each request runs in a
worker thread, under one lock: streams take turns inside the method, and the
event loop stays free to read and write other streams meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry import trace

from drafter.method import Draft, DrafterInfo, DraftMethod
from drafter.pipeline import Guess, PipelineStats, predraft, resolve
from specdec.draft_parts import response_parts
from specdec.draft_table import table_drafts
from specdec.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.sampling import SamplingParams
from specdec.server import DRAFT_PART_BYTES, GrpcService, draft_request_bytes, start_server
from specdec.telemetry import incoming_context
from specdec.tensor_codec import decode_tensor, dtype_to_proto, encode_tensor
from specdec.tls import TlsConfig

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("specdec.drafter")
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name  # specdec.v1.Drafter


Key = tuple[int, int]  # (stream number, seq_id)


class InvalidRequest(ValueError):
    """A request the verifier should never have sent; the message names the field."""


@dataclass(slots=True)
class _Stream:
    number: int
    rounds: dict[int, int] = field(default_factory=dict)  # seq_id -> round of its last entry
    last_step: int | None = None
    closed: bool = False  # set once its keys are freed; later work must not start any
    # Pipelining (drafter/pipeline.py): open bets, blocks won by a hit, the pass in flight.
    guesses: dict[int, Guess] = field(default_factory=dict)
    ready: dict[int, Draft] = field(default_factory=dict)
    wanted: dict[int, int] = field(default_factory=dict)  # seq_id -> K of the last request
    # Sequences the last request started or advanced, asked for drafts or not.
    advanced: list[int] = field(default_factory=list)
    predraft: asyncio.Future | None = None
    # Bets placed (DraftBet): seq_id -> (round of the Advance they answer, outcome -> drafts).
    bets: dict[int, tuple[int, dict[tuple[int, ...], list[int]]]] = field(default_factory=dict)
    tables: dict[int, drafter_pb2.DraftTable] = field(default_factory=dict)  # placed (DraftTable)
    max_k: dict[int, int] = field(default_factory=dict)  # seq_id -> its Start's largest K

    def forget(self, seq_id: int) -> None:
        self.guesses.pop(seq_id, None)
        self.ready.pop(seq_id, None)
        self.bets.pop(seq_id, None)
        self.tables.pop(seq_id, None)
        self.max_k.pop(seq_id, None)


def info_to_proto(info: DrafterInfo, max_request_bytes: int) -> drafter_pb2.InfoResponse:
    return drafter_pb2.InfoResponse(
        method=info.method,
        model_name=info.model_name,
        tokenizer=common_pb2.TokenizerFingerprint(vocab_size=info.vocab_size,
                                                  hash=info.tokenizer_hash),
        max_num_speculative_tokens=info.max_num_speculative_tokens,
        needs_hidden_states=info.needs_hidden_states,
        hidden_state_layers=info.hidden_state_layers,
        hidden_size=info.hidden_size,
        hidden_state_dtype=dtype_to_proto(info.hidden_state_dtype),
        target_model_name=info.target_model_name,
        returns_probs=info.returns_probs,
        supports_pipelining=info.supports_pipelining,
        max_model_len=info.max_model_len,
        max_request_bytes=max_request_bytes,
    )


def _chain(p: drafter_pb2.DraftProposal) -> bool:
    """A proposal of one-hot drafts in a chain (no draft probabilities, no tree): what
    bets and drafting ahead can follow."""
    return not p.HasField("probs") and not p.parents


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, method: DraftMethod, *, max_request_bytes: int | None = None,
                 part_bytes: int = DRAFT_PART_BYTES):
        """max_request_bytes: the largest request message it takes (None: a Start's
        largest for its context, draft_request_bytes); part_bytes: the largest message
        an answer is packed into (DraftResponse.continued), but a proposal larger."""
        self._method = method
        self._info = method.info()
        self.max_request_bytes = max_request_bytes or draft_request_bytes(
            self._info.max_model_len, self._info.vocab_size)
        self.part_bytes = part_bytes
        self._info_response = info_to_proto(self._info, self.max_request_bytes)
        self._lock = threading.Lock()
        self.pipelining = self._info.supports_pipelining
        self.pipeline_stats = PipelineStats()
        # Bets on the verifier's outcomes (DraftBet), from methods that can draft for a
        # context they do not hold yet (DraftMethod.propose_after).
        self.betting = type(method).propose_after is not DraftMethod.propose_after
        # ... or list every outcome's drafts (DraftMethod.outcome_table; a method may
        # decline per configuration, which the first sequence tells).
        self.tables = type(method).outcome_table is not DraftMethod.outcome_table
        self.bets_placed = 0
        self.bets_ms = 0.0  # spent placing them, after the proposals went out
        self._stream_numbers = itertools.count()
        self._entry_handlers: dict[str, Callable[..., int | None]] = {
            "start": self._start, "advance": self._advance, "free": self._free,
        }

    async def Info(self, request: drafter_pb2.InfoRequest,
                   context: grpc.aio.ServicerContext) -> drafter_pb2.InfoResponse:
        return self._info_response

    async def Draft(self, request_iterator: AsyncIterator[drafter_pb2.DraftRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[drafter_pb2.DraftResponse]:
        stream = _Stream(next(self._stream_numbers))
        span = _tracer.start_span("drafter.draft_stream",
                                  context=incoming_context(context.invocation_metadata()),
                                  attributes={"specdec.method": self._method.name,
                                              "specdec.stream": stream.number})
        try:
            parts: list[drafter_pb2.DraftRequest] = []  # of a step (DraftRequest.continued)
            async for request in request_iterator:
                received = time.perf_counter()
                if parts and request.step != parts[0].step:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"step: {request.step} continues step {parts[0].step}")
                parts.append(request)
                if request.continued:
                    continue
                step_parts, parts = parts, []
                if stream.predraft is not None:
                    await stream.predraft  # its bets must be placed before they are settled
                    stream.predraft = None
                try:
                    response = (self._handle(stream, step_parts) if self._method.light
                                else await asyncio.to_thread(self._handle, stream, step_parts))
                except InvalidRequest as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                response.bets_follow = (self.tables and bool(stream.advanced)) or (
                    self.betting and any(map(_chain, response.proposals)))
                response.draft_time_ms = (time.perf_counter() - received) * 1e3
                for part in response_parts(response, self.part_bytes):
                    yield part
                if response.bets_follow:
                    followup = (self._place_bets(stream, response) if self._method.light
                                else await asyncio.to_thread(self._place_bets, stream, response))
                    for part in response_parts(followup, self.part_bytes):
                        yield part
                if self.pipelining and self.pipeline_stats.worth_it():
                    bets = {(stream.number, p.seq_id): (p.round, list(p.token_ids),
                                                        stream.wanted[p.seq_id])
                            for p in response.proposals if _chain(p)}
                    if bets:
                        stream.predraft = asyncio.ensure_future(
                            asyncio.to_thread(self._predraft, stream, bets))
        finally:
            if self.betting:
                log.info("bets so far: %d placed in %.0f ms", self.bets_placed, self.bets_ms)
            if self.pipelining:
                st = self.pipeline_stats
                log.info("pipelining so far: %d hits, %d misses (hit rate %.2f), %.0f ms drafted "
                         "ahead, %d steps paused for a low hit rate", st.hits, st.misses,
                         st.hit_rate, st.predraft_ms, st.skipped)
            span.set_attribute("specdec.sequences", len(stream.rounds))
            span.end()
            if stream.predraft is not None:
                await asyncio.shield(stream.predraft)
            # Shielded: a second cancellation (server shutdown) must not leave keys behind.
            await asyncio.shield(asyncio.to_thread(self._close, stream))

    def _predraft(self, stream: _Stream, bets: dict[Key, tuple[int, list[int], int]]) -> None:
        with self._lock:
            if stream.closed:
                return
            guesses = predraft(self._method, bets, self.pipeline_stats)
            stream.guesses.update({key[1]: g for key, g in guesses.items()})

    def _place_bets(self, stream: _Stream,
                    response: drafter_pb2.DraftResponse) -> drafter_pb2.DraftResponse:
        """Bets on the outcomes of the response's proposals, as a followup message.

        One bet a proposal d, on the outcome users see most on the text drafters copy:
        every draft accepted and the target's next token the method's own next guess g.
        Its drafts continue the context after d + [g]. Any other outcome finds no bet,
        and the verifier waits for the proposal answering its Advance, as without bets."""
        t0 = time.perf_counter()
        followup = drafter_pb2.DraftResponse(step=response.step, followup=True)
        with self._lock:
            if stream.closed:
                return followup
            tabled = self._place_tables(stream, response, followup) if self.tables else set()
            for p in response.proposals:
                if p.seq_id in tabled:
                    continue
                key = (stream.number, p.seq_id)
                if not _chain(p) or not self._method.has(key):
                    continue
                drafts = list(p.token_ids)
                bonus = self._method.propose_after(key, drafts, 1)
                if not bonus:
                    continue
                outcome = [*drafts, bonus[0]]
                block = self._method.propose_after(
                    key, outcome, stream.wanted.get(p.seq_id, len(drafts)))
                if not block:
                    continue
                followup.bets.add(seq_id=p.seq_id, round=p.round + 1, new_token_ids=outcome,
                                  token_ids=block)
                stream.bets[p.seq_id] = (p.round + 1, {tuple(outcome): block})
            self.bets_placed += len(followup.bets) + len(followup.tables)
            self.bets_ms += (time.perf_counter() - t0) * 1e3
        return followup

    def _place_tables(self, stream: _Stream, response: drafter_pb2.DraftResponse,
                      followup: drafter_pb2.DraftResponse) -> set[int]:
        """A DraftTable for every sequence the request started or advanced, with a
        proposal or without (asked for none: a sequence the verifier's controller runs
        plain may draft again at the next step), where the method lists its outcomes;
        returns their seq_ids. Under the lock. The Advance is answered by the table
        (`_advance`): a method's own proposal may differ from its table's entry (suffix
        counts the new tokens first, and lists only some outcomes), and the next table
        must be on the drafts the verifier verifies."""
        proposed = {p.seq_id: p for p in response.proposals}
        tabled: set[int] = set()
        for seq_id in stream.advanced:
            p = proposed.get(seq_id)
            key = (stream.number, seq_id)
            if (p is not None and not _chain(p)) or not self._method.has(key):
                continue
            drafts = list(p.token_ids) if p is not None else []
            # Drafts for the largest K the sequence may ask for, no more: a table is
            # built for every sequence every step.
            outcomes = self._method.outcome_table(
                key, drafts, stream.max_k.get(seq_id, self._info.max_num_speculative_tokens))
            if outcomes is None:
                self.tables = False  # the method declines for its configuration
                return tabled
            table = followup.tables.add(seq_id=seq_id, round=stream.rounds[seq_id] + 1,
                                        proposal=drafts, k=outcomes.k,
                                        copy_unlisted=outcomes.copy_unlisted)
            for bonus, lengths, tokens in outcomes.groups:
                table.group_sizes.append(len(bonus))
                table.bonus.extend(bonus.tolist())
                table.lengths.extend(lengths.tolist())
                table.token_ids.extend(tokens.tolist())
            stream.tables[seq_id] = table
            tabled.add(seq_id)
        return tabled

    def _close(self, stream: _Stream) -> None:
        with self._lock:
            stream.closed = True
            for seq_id in stream.rounds:
                self._method.free((stream.number, seq_id))
            stream.rounds.clear()

    def _handle(self, stream: _Stream,
                parts: list[drafter_pb2.DraftRequest]) -> drafter_pb2.DraftResponse:
        """Apply a step's request, the entries of `parts` (its messages) in order."""
        step = parts[0].step
        if stream.last_step is not None and step <= stream.last_step:
            raise InvalidRequest(f"step: {step} is not greater than the stream's "
                                 f"previous step {stream.last_step}")
        stream.last_step = step
        response = drafter_pb2.DraftResponse(step=step)
        # key -> K. Several entries of a sequence (a split Advance; or Free then Start)
        # apply in order, and the last one decides the K.
        wanted: dict[Key, int] = {}
        advanced: dict[int, None] = {}  # in order, once each
        with self._lock:
            if stream.closed:  # the client left while this request waited for the lock
                return response
            for i, entry in enumerate(e for part in parts for e in part.entries):
                where = f"entries[{i}]"
                kind = entry.WhichOneof("kind")
                if kind is None:
                    raise InvalidRequest(f"{where}: no kind set (start, advance or free)")
                k = self._entry_handlers[kind](stream, entry, where)
                key = (stream.number, entry.seq_id)
                wanted.pop(key, None)
                advanced.pop(entry.seq_id, None)
                if kind != "free" and k is not None:
                    advanced[entry.seq_id] = None
                if k is None:
                    response.unknown_seq_ids.append(entry.seq_id)
                elif k > 0:
                    wanted[key] = min(k, self._info.max_num_speculative_tokens)
            stream.wanted = {key[1]: k for key, k in wanted.items()}
            stream.advanced = list(advanced)
            if wanted:
                self._add_proposals(response, stream, wanted)
        return response

    # Entry handlers: apply one entry and return the K it asks for, or None when the
    # stream holds no (valid) state for the sequence.

    def _start(self, stream: _Stream, entry: drafter_pb2.DraftEntry, where: str) -> int | None:
        start = entry.start
        self._check_token_ids(start.prompt_token_ids, f"{where}.start.prompt_token_ids")
        self._check_token_ids(start.output_token_ids, f"{where}.start.output_token_ids")
        try:
            sampling = SamplingParams.from_proto(start.sampling)
        except ValueError as e:
            raise InvalidRequest(f"{where}.start.sampling: {e}") from None
        key = (stream.number, entry.seq_id)
        stream.forget(entry.seq_id)
        if entry.seq_id in stream.rounds:
            self._method.free(key)  # a re-Start replaces the sequence's state
        # Recorded before the method runs, so the stream frees it even if start fails.
        stream.rounds[entry.seq_id] = entry.round
        cap = self._info.max_num_speculative_tokens
        max_num_speculative_tokens = min(start.max_num_speculative_tokens or cap, cap)
        stream.max_k[entry.seq_id] = max_num_speculative_tokens
        try:
            self._method.start(key, list(start.prompt_token_ids), list(start.output_token_ids),
                               sampling, max_num_speculative_tokens)
            if start.tenant:
                self._method.scope(key, start.tenant)
        except ValueError as e:
            raise InvalidRequest(f"{where}.start: {e}") from None
        return start.num_speculative_tokens

    def _advance(self, stream: _Stream, entry: drafter_pb2.DraftEntry, where: str) -> int | None:
        adv = entry.advance
        if adv.num_accepted > adv.num_drafted or adv.num_accepted > len(adv.new_token_ids):
            raise InvalidRequest(
                f"{where}.advance.num_accepted: {adv.num_accepted} exceeds num_drafted "
                f"({adv.num_drafted}) or new_token_ids ({len(adv.new_token_ids)} tokens)")
        self._check_token_ids(adv.new_token_ids, f"{where}.advance.new_token_ids")
        hidden = self._hidden_states(adv, f"{where}.advance.hidden_states")
        key = (stream.number, entry.seq_id)
        previous = stream.rounds.get(entry.seq_id)
        if previous is None:
            return None
        guess = stream.guesses.pop(entry.seq_id, None)
        stream.ready.pop(entry.seq_id, None)
        bets = stream.bets.pop(entry.seq_id, None)
        table = stream.tables.pop(entry.seq_id, None)
        if guess is not None and self._method.has(key):
            ready = resolve(self._method, key, guess, entry.round, list(adv.new_token_ids),
                            adv.num_rollback_tokens, self.pipeline_stats)
            if ready is not None and entry.round == previous + 1:
                stream.rounds[entry.seq_id] = entry.round
                stream.ready[entry.seq_id] = ready  # the state already includes this outcome
                return adv.num_speculative_tokens
        if entry.round != previous + 1 or not self._method.has(key):
            # Out of sync (a lost or repeated step) or evicted: drafting from this state
            # would propose for the wrong context, so drop it and let the verifier re-start.
            del stream.rounds[entry.seq_id]
            self._method.free(key)
            return None
        stream.rounds[entry.seq_id] = entry.round
        try:
            self._method.advance(key, adv.num_drafted, adv.num_accepted, list(adv.new_token_ids),
                                 adv.num_rollback_tokens, hidden,
                                 adv.hidden_states.start_position)
        except ValueError as e:
            raise InvalidRequest(f"{where}.advance: {e}") from None
        if bets is not None and bets[0] == entry.round and not adv.num_rollback_tokens:
            block = bets[1].get(tuple(adv.new_token_ids))
            if block is not None:
                # The verifier may have taken this bet: answer with the same drafts, so
                # the bets placed on them are bets on what it verifies.
                stream.ready[entry.seq_id] = Draft(block)
        if table is not None and table.round == entry.round and not adv.num_rollback_tokens:
            drafts = table_drafts(table, list(adv.new_token_ids))
            if drafts is not None:
                # The verifier took this outcome's drafts from the table (none, for an
                # outcome it does not list): answer the same, as for a bet.
                stream.ready[entry.seq_id] = Draft(drafts)
        return adv.num_speculative_tokens

    def _free(self, stream: _Stream, entry: drafter_pb2.DraftEntry, where: str) -> int | None:
        # Freeing a sequence the stream does not hold is harmless: nothing to report.
        stream.forget(entry.seq_id)
        if stream.rounds.pop(entry.seq_id, None) is not None:
            self._method.free((stream.number, entry.seq_id))
        return 0

    def _hidden_states(self, adv: drafter_pb2.DraftEntry.Advance,
                       where: str) -> torch.Tensor | None:
        """[P, len(layers), hidden_size] in the dtype Info asked for, or None if not needed."""
        info = self._info
        if not info.needs_hidden_states:
            return None
        if not adv.HasField("hidden_states"):
            if adv.new_token_ids:
                raise InvalidRequest(f"{where}: missing; this drafter needs hidden states of "
                                     f"layers {info.hidden_state_layers}")
            return None  # an Advance that only asks for a proposal carries no positions
        msg = adv.hidden_states
        if list(msg.layers) != info.hidden_state_layers:
            raise InvalidRequest(f"{where}.layers: {list(msg.layers)} differ from the "
                                 f"drafter's hidden_state_layers {info.hidden_state_layers}")
        try:
            return decode_tensor(
                msg.tensor, expected_dtype=info.hidden_state_dtype,
                expected_shape=[-1, len(info.hidden_state_layers), info.hidden_size])
        except ValueError as e:
            raise InvalidRequest(f"{where}.tensor: {e}") from None

    def _check_token_ids(self, ids, where: str) -> None:
        if not ids:
            return
        low, high = min(ids), max(ids)
        vocab = self._info.vocab_size  # 0 = any tokenizer
        if low < 0 or (vocab and high >= vocab):
            raise InvalidRequest(f"{where}: token ids must be in [0, {vocab or 'vocab_size'}), "
                                 f"got {low if low < 0 else high}")

    def _add_proposals(self, response: drafter_pb2.DraftResponse, stream: _Stream,
                       wanted: dict[Key, int]) -> None:
        # Blocks drafted ahead by a pipelining hit need no work now.
        # (Drafted for the previous K, so cut to this one.)
        drafts = {key: Draft(stream.ready.pop(key[1]).token_ids[:k])
                  for key, k in wanted.items() if key[1] in stream.ready}
        drafts.update(self._method.propose({key: k for key, k in wanted.items() if key not in drafts}))
        stream.ready.clear()
        for key, k in wanted.items():
            draft = drafts.get(key)
            if draft is None or not draft.token_ids:
                continue  # nothing to propose: the verifier runs the sequence with K = 0
            if len(draft.token_ids) > k:
                raise RuntimeError(f"{type(self._method).__name__} drafted "
                                   f"{len(draft.token_ids)} tokens for K = {k}")
            seq_id = key[1]
            proposal = response.proposals.add(seq_id=seq_id, round=stream.rounds[seq_id],
                                              token_ids=draft.token_ids, parents=draft.parents)
            if draft.probs is not None:
                # [k, V] float32, as the proto prefers.
                proposal.probs.dense.CopyFrom(encode_tensor(draft.probs.to(torch.float32)))


async def serve(method: DraftMethod, address: str, token: str | None = None,
                tls: TlsConfig | None = None, **limits: int) -> GrpcService:
    """Start a Drafter service for `method` on `address` ("host:port", port 0 = any free
    port) with health reporting SERVING; stop it with the returned service's `stop`.
    token: required of every call but health's (specdec.server.TokenAuth); tls: serve
    over TLS; limits: DrafterServicer's max_request_bytes and part_bytes."""
    servicer = DrafterServicer(method, **limits)

    def register(server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)

    return await start_server(address, register, [SERVICE_NAME], servicer, token=token,
                              tls=tls, max_receive_bytes=servicer.max_request_bytes)
