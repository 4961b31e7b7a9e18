"""The verifier's drafter stream against a hung drafter: a process whose connection stays
up but that answers nothing is cut off after the liveness deadline and reconnected, its
sequences re-started on the new stream; the queue of unsent requests is bounded. A
sequence at K = 0 sends nothing until it drafts again or ends."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.draft_table import table_drafts
from specdec.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.sampling import SamplingParams
from specdec.tensor_codec import decode_tensor, dtype_to_proto
from tests.ports import free_port
from verifier.drafter_client import (
    HOLD_HOST_ROWS,
    DrafterClient,
    TargetInfo,
    _Seq,
)
from verifier.engine.proposer import Outcome, Proposal

TARGET = TargetInfo(vocab_size=100, tokenizer_hash="", hidden_size=16, num_layers=2)


class NgramInfo(drafter_pb2_grpc.DrafterServicer):
    """A drafter that says it is ngram for TARGET, up to K = 8."""

    def Info(self, request, context):
        return drafter_pb2.InfoResponse(
            method=common_pb2.SPEC_METHOD_NGRAM, max_num_speculative_tokens=8,
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=TARGET.vocab_size))


class HangsOnce(NgramInfo):
    """Reads its first stream's requests and never answers; answers every request of
    later streams at once, with no proposals."""

    def __init__(self):
        self.streams = 0
        self.starts: list[list[int]] = []  # per stream: the seq ids it was told to start
        self.lock = threading.Lock()

    def Draft(self, request_iterator, context):
        with self.lock:
            self.streams += 1
            hang = self.streams == 1
            starts: list[int] = []
            self.starts.append(starts)
        for req in request_iterator:
            starts += [e.seq_id for e in req.entries if e.WhichOneof("kind") == "start"]
            if not hang:
                yield drafter_pb2.DraftResponse(step=req.step)


def serve(servicer: drafter_pb2_grpc.DrafterServicer) -> tuple[grpc.Server, str]:
    """`servicer` on a free local port: the server and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}"


@contextlib.contextmanager
def connected(servicer: drafter_pb2_grpc.DrafterServicer) -> Iterator[DrafterClient]:
    """A DrafterClient connected to `servicer`, served on a free port."""
    server, address = serve(servicer)
    client = DrafterClient("d", address, TARGET).start()
    try:
        assert client.wait_available(10), client.error
        yield client
    finally:
        client.close()
        server.stop(0)


def test_a_hung_drafter_is_cut_off_and_reconnected():
    servicer = HangsOnce()
    server, address = serve(servicer)
    client = DrafterClient("d", address, TARGET, backoff_s=(0.05, 0.1),
                           liveness_s=0.3).start()
    try:
        assert client.wait_available(10), client.error
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        assert client.send(1, {1: 4})
        assert client.collect(1, time.monotonic() + 0.05, {1: 4}) == {}
        assert client.misses == {1: "deadline"}
        # Steps go on with K = 0 while the answer is outstanding; past the liveness
        # deadline the stream is cut and the drafter reconnected.
        step, t0 = 2, time.monotonic()
        while servicer.streams < 2 and time.monotonic() - t0 < 10:
            client.send(step, {1: 4})
            client.collect(step, time.monotonic() + 0.02, {1: 4})
            step += 1
        assert servicer.streams == 2
        assert time.monotonic() - t0 >= 0.25  # not before the deadline
        assert client.wait_available(10)
        # The new stream re-starts the sequence, and answers arrive again.
        t1 = time.monotonic()
        while time.monotonic() - t1 < 10:
            due = client.send(step, {1: 4})
            if due:
                client.collect(step, time.monotonic() + 1.0, {1: 4})
                if client.misses == {}:
                    break
            step += 1
        assert client.misses == {}
        assert servicer.starts[1] == [1]
    finally:
        client.close()
        server.stop(0)


def test_the_unsent_queue_is_bounded():
    client = DrafterClient("d", "127.0.0.1:1", TARGET, max_queued=3)
    q: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(3):
        q.put(object())
    assert client._hung(q) is None
    q.put(object())
    assert client._hung(q) == "4 requests queued unsent"


class Records(drafter_pb2_grpc.DrafterServicer):
    """Wants hidden states of layer 1; keeps every request, answers each at once."""

    def __init__(self):
        self.requests: list[drafter_pb2.DraftRequest] = []
        self.arrived = threading.Condition()

    def Info(self, request, context):
        return drafter_pb2.InfoResponse(
            method=common_pb2.SPEC_METHOD_EAGLE3, max_num_speculative_tokens=8,
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=TARGET.vocab_size),
            needs_hidden_states=True, hidden_state_layers=[1], hidden_size=TARGET.hidden_size,
            hidden_state_dtype=dtype_to_proto(torch.float32))

    def Draft(self, request_iterator, context):
        for req in request_iterator:
            with self.arrived:
                self.requests.append(req)
                self.arrived.notify_all()
            yield drafter_pb2.DraftResponse(step=req.step)

    def wait_for(self, n: int) -> list[drafter_pb2.DraftRequest]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.requests) >= n, timeout=10)
            return list(self.requests)


def states(start: int, rows: int, device: str = "cpu") -> torch.Tensor:
    """[rows, 1, hidden]: position p's state is p everywhere, to be told apart."""
    return torch.arange(start, start + rows, dtype=torch.float32, device=device)[
        :, None, None].expand(rows, 1, TARGET.hidden_size).contiguous()


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_outcomes_of_k0_steps_are_held_until_the_sequence_drafts_or_ends(device):
    servicer = Records()
    with connected(servicer) as client:
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        assert not client.send(1, {1: 0})  # the Start, nothing due
        assert servicer.wait_for(1)[0].entries[0].WhichOneof("kind") == "start"
        # Three plain steps (K = 0): nothing goes out.
        for step, token in zip((2, 3, 4), (10, 11, 12), strict=True):
            client.record(1, Outcome(0, 0, [token], states(step, 1, device), step))
            assert not client.send(step + 1, {1: 0})
        # Asked for drafts: the three in one Advance, states of positions 2..4 in order.
        client.record(1, Outcome(0, 0, [13], states(5, 1, device), 5))
        assert client.send(6, {1: 3})
        entry = servicer.wait_for(2)[1].entries[0]
        assert len(servicer.requests) == 2
        adv = entry.advance
        assert (entry.round, list(adv.new_token_ids), adv.num_speculative_tokens) == \
            (1, [10, 11, 12, 13], 3)
        assert (adv.num_drafted, adv.num_accepted, adv.hidden_states.start_position) == (0, 0, 2)
        assert torch.equal(decode_tensor(adv.hidden_states.tensor), states(2, 4))
        client.collect(6, time.monotonic() + 1, {1: 3})
        # A drafting step's outcome goes out at the next step, K = 0 or not.
        client.record(1, Outcome(3, 1, [14, 15], states(6, 4, device), 6))
        assert not client.send(7, {1: 0})
        adv = servicer.wait_for(3)[2].entries[0].advance
        assert (list(adv.new_token_ids), adv.num_drafted, adv.num_accepted) == ([14, 15], 3, 1)
        # Held no further than HOLD_HOST_ROWS steps.
        for i in range(HOLD_HOST_ROWS):
            client.record(1, Outcome(0, 0, [20 + i], states(8 + i, 1, device), 8 + i))
            client.send(8 + i, {1: 0})
        adv = servicer.wait_for(4)[3].entries[0].advance
        assert list(adv.new_token_ids) == list(range(20, 20 + HOLD_HOST_ROWS))
        assert torch.equal(decode_tensor(adv.hidden_states.tensor), states(8, HOLD_HOST_ROWS))
        # Freed with an outcome held: a drafter that drafts from hidden states gets the Free
        # alone (it refuses tokens without their states, and has no use for them now).
        client.record(1, Outcome(0, 0, [99], states(8 + HOLD_HOST_ROWS, 1, device), 8 + HOLD_HOST_ROWS))
        client.forget(1)
        client.send(200, {})
        (free,) = servicer.wait_for(5)[4].entries
        assert (free.seq_id, free.WhichOneof("kind")) == (1, "free")


def test_held_rows_left_in_the_feature_store_are_read_when_they_go_out():
    """Outcomes whose rows the engine left in its feature store (hidden_kept) are read
    only when they go out, consecutive ones in one read, in order with rows taken out;
    a sequence whose rows are gone by then (preempted) starts over from its tokens."""
    servicer = Records()
    store = states(0, 64)  # [64, 1, H]: position p's row, as the store keeps it
    reads = []

    def read(seq_id, start, num):
        reads.append((seq_id, start, num))
        return None if seq_id == 2 else store[start: start + num].reshape(num, -1)

    with connected(servicer) as client:
        client.read_features = read
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        client.track(2, [4, 5], SamplingParams(), 4)
        client.send(1, {1: 0, 2: 0})
        servicer.wait_for(1)
        # Sequence 1: its prompt's rows (0..2) and two plain steps in the store, then a
        # step's rows taken out; sequence 2: a plain step in the store.
        client.record(1, Outcome(0, 0, [], None, 0, hidden_kept=3))
        client.record(1, Outcome(0, 0, [10], None, 3, hidden_kept=1))
        client.record(1, Outcome(0, 0, [11], None, 4, hidden_kept=1))
        client.record(1, Outcome(0, 0, [12], states(5, 1), 5))
        client.record(2, Outcome(0, 0, [20], None, 2, hidden_kept=1))
        assert not client.send(2, {1: 0, 2: 0})
        assert reads == []  # held, nothing read
        assert client.send(3, {1: 2, 2: 2})
        entries = {e.seq_id: e for e in servicer.wait_for(2)[1].entries}
        adv = entries[1].advance
        assert (list(adv.new_token_ids), adv.hidden_states.start_position) == ([10, 11, 12], 0)
        assert torch.equal(decode_tensor(adv.hidden_states.tensor), states(0, 6))
        assert reads == [(1, 0, 5), (2, 2, 1)]  # the store's range of sequence 1 in one read
        start = entries[2].start
        assert (list(start.prompt_token_ids), list(start.output_token_ids)) == ([4, 5], [20])


def test_rows_left_in_the_feature_store_are_held_until_the_sequence_drafts_however_many():
    """Held rows that stay in the store cost no memory: a sequence running plain past
    HOLD_HOST_ROWS of them sends nothing, and they go out in one read when it drafts
    (sent every HOLD_HOST_ROWS, an EAGLE head took them in while its batch ran plain)."""
    servicer = Records()
    n = 2 * HOLD_HOST_ROWS + 5
    store = states(0, n + 3)
    reads = []

    def read(seq_id, start, num):
        reads.append((seq_id, start, num))
        return store[start: start + num].reshape(num, -1)

    with connected(servicer) as client:
        client.read_features = read
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        client.send(1, {1: 0})
        servicer.wait_for(1)
        client.record(1, Outcome(0, 0, [], None, 0, hidden_kept=3))
        for i in range(n):
            client.record(1, Outcome(0, 0, [10 + i], None, 3 + i, hidden_kept=1))
            assert not client.send(2 + i, {1: 0})
        assert len(servicer.requests) == 1 and reads == []
        assert client.send(2 + n, {1: 2})
        adv = servicer.wait_for(2)[1].entries[0].advance
        assert list(adv.new_token_ids) == [10 + i for i in range(n)]
        assert torch.equal(decode_tensor(adv.hidden_states.tensor), states(0, n + 3))
        assert reads == [(1, 0, n + 3)]


class RecordsTokens(Records):
    """Records, for a drafter that reads tokens only (as a suffix drafter does)."""

    def Info(self, request, context):
        return drafter_pb2.InfoResponse(
            method=common_pb2.SPEC_METHOD_SUFFIX, max_num_speculative_tokens=8,
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=TARGET.vocab_size))


def test_a_drafter_without_hidden_states_gets_a_freed_sequences_held_tokens():
    # A suffix drafter learns from whole replies: a sequence freed with K = 0 outcomes
    # held sends their tokens before its Free.
    servicer = RecordsTokens()
    with connected(servicer) as client:
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        client.send(1, {1: 0})
        servicer.wait_for(1)
        for step, token in zip((2, 3), (10, 11), strict=True):
            client.record(1, Outcome(0, 0, [token], None, step))
            assert not client.send(step, {1: 0})
        client.forget(1)
        client.send(4, {})
        last, free = servicer.wait_for(2)[1].entries
        assert (last.seq_id, last.round, list(last.advance.new_token_ids)) == (1, 1, [10, 11])
        assert not last.advance.HasField("hidden_states")
        assert (free.seq_id, free.WhichOneof("kind")) == (1, "free")


def test_two_outcomes_of_one_step_reach_the_drafter_as_one():
    # A prefill whose first positions came from the prefix cache advances twice in one
    # step (the cached positions' states, then the chunk's): both reach the drafter, in
    # one Advance, rather than re-starting the sequence without its states.
    servicer = Records()
    with connected(servicer) as client:
        client.track(1, [1, 2, 3, 4, 5, 6], SamplingParams(), 4)
        client.send(1, {})
        servicer.wait_for(1)
        client.record(1, Outcome(0, 0, [], states(0, 4), 0))
        client.record(1, Outcome(0, 0, [7], states(4, 2), 4))
        assert client.send(2, {1: 2})
        entries = servicer.wait_for(2)[1].entries
        assert [e.WhichOneof("kind") for e in entries] == ["advance"]
        adv = entries[0].advance
        assert list(adv.new_token_ids) == [7] and adv.hidden_states.start_position == 0
        assert torch.equal(decode_tensor(adv.hidden_states.tensor), states(0, 6))


def test_held_rows_past_a_message_go_out_as_advances_of_consecutive_rows():
    """Held hidden states larger than a message go out as several Advances, a round each,
    each with the tokens through its last row's position and the K on the last; the
    step's request is packed into messages of at most part_bytes."""
    servicer = Records()
    row = TARGET.hidden_size * 4 + 5  # a float32 row of one layer, and its token
    server, address = serve(servicer)
    client = DrafterClient("d", address, TARGET, part_bytes=256 + 4 * row).start()
    try:
        assert client.wait_available(10), client.error
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        client.track(2, [4, 5], SamplingParams(), 4)
        client.send(1, {})
        servicer.wait_for(1)
        # Sequence 1: its prompt's rows (positions 0..2) with its first token, then seven
        # plain steps; sequence 2: one plain step.
        client.record(1, Outcome(0, 0, [10], states(0, 3), 0))
        for i in range(7):
            client.record(1, Outcome(0, 0, [11 + i], states(3 + i, 1), 3 + i))
        client.record(2, Outcome(0, 0, [20], states(1, 1), 1))
        assert client.send(2, {1: 2, 2: 3})
        requests = servicer.wait_for(4)[1:]
        assert [r.continued for r in requests] == [True, True, False]
        assert all(r.step == 2 and r.ByteSize() <= client.part_bytes for r in requests)
        entries = [e for r in requests for e in r.entries]
        assert [(e.seq_id, e.round) for e in entries] == [(1, 1), (1, 2), (1, 3), (2, 1)]
        advs = [e.advance for e in entries[:3]]
        assert [list(a.new_token_ids) for a in advs] == [[10], [11, 12, 13, 14], [15, 16, 17]]
        assert [a.hidden_states.start_position for a in advs] == [0, 4, 8]
        assert [a.num_speculative_tokens for a in advs] == [0, 0, 2]
        assert torch.equal(torch.cat([decode_tensor(a.hidden_states.tensor) for a in advs]),
                           states(0, 10))
        assert entries[3].advance.num_speculative_tokens == 3
    finally:
        client.close()
        server.stop(0)


class TakesLittle(RecordsTokens):
    """RecordsTokens, for a drafter that takes messages of at most 2000 bytes."""

    def Info(self, request, context):
        info = super().Info(request, context)
        info.max_request_bytes = 2000
        return info


def test_a_sequence_whose_start_exceeds_what_the_drafter_takes_runs_without_it():
    servicer = TakesLittle()
    server, address = serve(servicer)
    client = DrafterClient("d", address, TARGET, part_bytes=1000).start()
    try:
        assert client.wait_available(10), client.error
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        client.track(2, [7] * 2500, SamplingParams(), 4)  # a Start of over 2500 bytes
        client.send(1, {1: 2, 2: 2})
        (request,) = servicer.wait_for(1)
        assert [(e.seq_id, e.WhichOneof("kind")) for e in request.entries] == \
            [(1, "start"), (2, "free")]
        # Not tracked any more: its outcomes and asks send nothing.
        client.record(2, Outcome(0, 0, [8], None, 2500))
        client.record(1, Outcome(2, 1, [4, 5], None, 3))
        client.send(2, {1: 2, 2: 2})
        entries = servicer.wait_for(2)[1].entries
        assert [(e.seq_id, e.WhichOneof("kind")) for e in entries] == [(1, "advance")]
    finally:
        client.close()
        server.stop(0)


class BetsThenHolds(NgramInfo):
    """Answers step 1 with drafts [5, 6] and bets that the outcome 5 6 7 is followed by
    8 9 10; answers later steps (drafts [8, 9, 10], no bets) only once `release` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.requests: list[drafter_pb2.DraftRequest] = []

    def Draft(self, request_iterator, context):
        for req in request_iterator:
            self.requests.append(req)
            (entry,) = req.entries
            if req.step == 1:
                yield drafter_pb2.DraftResponse(step=1, bets_follow=True, proposals=[
                    drafter_pb2.DraftProposal(seq_id=1, round=entry.round, token_ids=[5, 6])])
                yield drafter_pb2.DraftResponse(step=1, followup=True, bets=[
                    drafter_pb2.DraftBet(seq_id=1, round=entry.round + 1,
                                         new_token_ids=[5, 6, 7], token_ids=[8, 9, 10])])
                continue
            self.release.wait(30)
            yield drafter_pb2.DraftResponse(step=req.step, proposals=[
                drafter_pb2.DraftProposal(seq_id=1, round=entry.round, token_ids=[8, 9, 10])])


def test_a_step_whose_outcome_a_bet_named_does_not_wait_for_the_answer():
    servicer = BetsThenHolds()
    with connected(servicer) as client:
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        assert client.send(1, {1: 2}, time.monotonic() + 10)
        assert client.collect(1, time.monotonic() + 10, {1: 2}) == {1: Proposal([5, 6])}
        client.record(1, Outcome(num_drafted=2, num_accepted=2, new_token_ids=[5, 6, 7]))
        # The bet is taken while the drafter holds its answer to step 2: nothing is due.
        assert not client.send(2, {1: 3}, time.monotonic() + 10)
        assert client.collect(2, time.monotonic() + 10, {1: 3}, due=False) == {
            1: Proposal([8, 9, 10])}
        assert (client.bet_lookups, client.bet_hits, client.misses) == (1, 1, {})
        # The drafter was still asked, with the outcome, for the bets on what follows.
        t0 = time.monotonic()
        while len(servicer.requests) < 2 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        advance = servicer.requests[1].entries[0].advance
        assert (list(advance.new_token_ids), advance.num_speculative_tokens) == ([5, 6, 7], 3)

        # An outcome no bet named: the step waits for the drafter's answer.
        client.record(1, Outcome(num_drafted=3, num_accepted=1, new_token_ids=[8, 4]))
        servicer.release.set()
        assert client.send(3, {1: 3}, time.monotonic() + 10)
        assert client.collect(3, time.monotonic() + 10, {1: 3}) == {1: Proposal([8, 9, 10])}
        assert (client.bet_lookups, client.bet_hits) == (2, 1)


class TablesThenHolds(NgramInfo):
    """Answers step 1 with drafts [5, 6] and a DraftTable of its outcomes, step 2 with no
    drafts and a table (4 -> [11, 12]); answers later steps only once `release` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.requests: list[drafter_pb2.DraftRequest] = []

    def Draft(self, request_iterator, context):
        for req in request_iterator:
            self.requests.append(req)
            (entry,) = req.entries
            if req.step == 1:
                yield drafter_pb2.DraftResponse(step=1, bets_follow=True, proposals=[
                    drafter_pb2.DraftProposal(seq_id=1, round=entry.round, token_ids=[5, 6])])
                # After 9: 1 2; after 5 7: 3; after 5 6 7: 8 9 10; after 5 6 8: 4.
                yield drafter_pb2.DraftResponse(step=1, followup=True, tables=[
                    drafter_pb2.DraftTable(seq_id=1, round=entry.round + 1, proposal=[5, 6],
                                           group_sizes=[1, 1, 2], bonus=[9, 7, 7, 8],
                                           lengths=[2, 1, 3, 1],
                                           token_ids=[1, 2, 3, 8, 9, 10, 4])])
            elif req.step == 2:
                yield drafter_pb2.DraftResponse(step=2, bets_follow=True)
                yield drafter_pb2.DraftResponse(step=2, followup=True, tables=[
                    drafter_pb2.DraftTable(seq_id=1, round=entry.round + 1, group_sizes=[1],
                                           bonus=[4], lengths=[2], token_ids=[11, 12])])
            else:
                self.release.wait(30)
                yield drafter_pb2.DraftResponse(step=req.step, proposals=[
                    drafter_pb2.DraftProposal(seq_id=1, round=entry.round, token_ids=[11])])


def test_a_table_answers_every_outcome_without_waiting_for_the_drafter():
    servicer = TablesThenHolds()
    with connected(servicer) as client:
        client.track(1, [1, 2, 3], SamplingParams(), 4)
        assert client.send(1, {1: 2}, time.monotonic() + 10)
        assert client.collect(1, time.monotonic() + 10, {1: 2}) == {1: Proposal([5, 6])}
        # One draft accepted, then 3, which the table does not list: no drafts, and
        # nothing to wait for.
        client.record(1, Outcome(num_drafted=2, num_accepted=1, new_token_ids=[5, 3]))
        t0 = time.monotonic()  # the table follows the answer: ready once it is here
        while client.ready_drafts(1) is None and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert client.ready_drafts(1) == 0  # the table says none
        assert not client.send(2, {1: 4}, time.monotonic() + 10)
        assert client.collect(2, time.monotonic() + 10, {1: 4}, due=False) == {}
        assert (client.bet_lookups, client.bet_hits, client.misses) == (1, 1, {})
        # That step ran plain; its outcome is held, and the table the drafter placed on
        # the Advance's context names it.
        client.record(1, Outcome(num_drafted=0, num_accepted=0, new_token_ids=[4]))
        assert not client.send(3, {1: 4}, time.monotonic() + 10)
        assert client.collect(3, time.monotonic() + 10, {1: 4}, due=False) == {
            1: Proposal([11, 12])}
        assert (client.bet_lookups, client.bet_hits, client.misses) == (2, 2, {})
        t0 = time.monotonic()
        while len(servicer.requests) < 3 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        advances = [r.entries[0].advance for r in servicer.requests[1:]]
        assert [(list(a.new_token_ids), a.num_drafted, a.num_speculative_tokens)
                for a in advances] == [([5, 3], 2, 4), ([4], 0, 4)]
        servicer.release.set()


class RecordsTabling(RecordsTokens):
    """RecordsTokens that follows every answer with a table for each sequence it was
    sent: no token listed, so every outcome's drafts are none."""

    def Draft(self, request_iterator, context):
        for req in request_iterator:
            with self.arrived:
                self.requests.append(req)
                self.arrived.notify_all()
            yield drafter_pb2.DraftResponse(step=req.step, bets_follow=True)
            yield drafter_pb2.DraftResponse(step=req.step, followup=True, tables=[
                drafter_pb2.DraftTable(seq_id=e.seq_id, round=e.round + 1, group_sizes=[0])
                for e in req.entries if e.WhichOneof("kind") != "free"])


def test_a_drafter_that_places_tables_gets_every_steps_outcome():
    """A table answers one step's outcome. A sequence run plain is sent to a drafter that
    places tables each step, K = 0, so the table it drafts from next is on its context
    (held for two steps, its outcome would be one no table names, and waited for)."""
    for servicer, sent in ((RecordsTokens(), [[10, 11, 12]]),
                           (RecordsTabling(), [[10], [11], [12]])):
        with connected(servicer) as client:
            client.track(1, [1, 2, 3], SamplingParams(), 4)
            client.send(1, {1: 0})
            servicer.wait_for(1)
            for step, token in zip((2, 3), (10, 11), strict=True):
                t0 = time.monotonic()  # the table follows the answer
                while (isinstance(servicer, RecordsTabling) and not client._tabling
                       and time.monotonic() - t0 < 10):
                    time.sleep(0.01)
                client.record(1, Outcome(0, 0, [token], None, step))
                assert not client.send(step, {1: 0})
            client.record(1, Outcome(0, 0, [12], None, 4))
            # The next drafting step: the tabling drafter's table names its outcome.
            t0 = time.monotonic()
            while (len(sent) > 1 and client.ready_drafts(1) is None
                   and time.monotonic() - t0 < 10):
                time.sleep(0.01)
            client.send(4, {1: 2}, time.monotonic() + 10)
            assert client.bet_hits == (len(sent) > 1)
            requests = servicer.wait_for(1 + len(sent))
            advances = [list(e.advance.new_token_ids) for r in requests[1:] for e in r.entries]
            assert advances == sent


def test_table_drafts_reads_each_group_and_refuses_other_outcomes():
    table = drafter_pb2.DraftTable(proposal=[5, 6], group_sizes=[1, 1, 2], bonus=[9, 7, 7, 8],
                                   lengths=[2, 1, 3, 1], token_ids=[1, 2, 3, 8, 9, 10, 4])
    assert table_drafts(table, [9]) == [1, 2]
    assert table_drafts(table, [5, 7]) == [3]
    assert table_drafts(table, [5, 6, 7]) == [8, 9, 10]
    assert table_drafts(table, [5, 6, 8]) == [4]
    assert table_drafts(table, [5, 6, 9]) == [] and table_drafts(table, [7]) == []
    # Not the proposal's prefix, or past its end: outcomes the table cannot answer.
    assert table_drafts(table, [6, 7]) is None
    assert table_drafts(table, [5, 6, 7, 8]) is None
    assert table_drafts(table, []) is None


def test_a_table_copies_after_an_unlisted_tokens_latest_occurrence():
    """With copy_unlisted, a token the group does not list gets the tokens that followed
    its latest earlier occurrence in the sequence's context (a one-token match), through
    the token itself, cut to the table's k; a token never seen gets none."""
    table = drafter_pb2.DraftTable(proposal=[5], group_sizes=[0, 1], bonus=[9], lengths=[1],
                                   token_ids=[4], k=3, copy_unlisted=True)
    seq = _Seq([1, 2, 3, 1, 7, 8], SamplingParams(), 4)
    seq.output = [5, 2]  # context 1 2 3 1 7 8 5 | 2: 2 last occurred at position 1
    assert table_drafts(table, [5, 2], seq.copy_after) == [3, 1, 7]
    assert table_drafts(table, [5, 9], seq.copy_after) == [4]  # listed: the entry
    seq.output = [5, 2, 6, 6]  # the context grows; 6 last occurred just before the end
    assert table_drafts(table, [6], seq.copy_after) == [6]
    seq.output = [5, 2, 6, 6, 0]
    assert table_drafts(table, [0], seq.copy_after) == []
    assert table_drafts(table, [5, 2]) is None  # a copy needs the context


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 5), min_size=1, max_size=12),
       growth=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3), st.integers(0, 6),
                                 st.integers(1, 4)), max_size=6))
def test_copy_after_matches_a_scan_of_the_context_as_it_grows(prompt, growth):
    """copy_after indexes the context incrementally; whatever the pieces it grows by, it
    answers as a scan of the whole context for the token's latest occurrence before the
    last token does."""
    seq = _Seq(list(prompt), SamplingParams(), 4)
    for new, token, k in growth:
        seq.output.extend(new)
        context = seq.prompt + seq.output
        latest = max((i for i, t in enumerate(context[:-1]) if t == token), default=None)
        expected = [] if latest is None else context[latest + 1:latest + 1 + k]
        assert seq.copy_after(token, k) == expected
