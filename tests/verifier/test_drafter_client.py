"""The verifier's drafter stream against a hung drafter: a process whose connection stays
up but that answers nothing is cut off after the liveness deadline and reconnected, its
sequences re-started on the new stream; the queue of unsent requests is bounded."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc

from specdec.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.sampling import SamplingParams
from tests.ports import free_port
from verifier.drafter_client import DrafterClient, TargetInfo

TARGET = TargetInfo(vocab_size=100, tokenizer_hash="", hidden_size=16, num_layers=2)


class HangsOnce(drafter_pb2_grpc.DrafterServicer):
    """Reads its first stream's requests and never answers; answers every request of
    later streams at once, with no proposals."""

    def __init__(self):
        self.streams = 0
        self.starts: list[list[int]] = []  # per stream: the seq ids it was told to start
        self.lock = threading.Lock()

    def Info(self, request, context):
        return drafter_pb2.InfoResponse(
            method=common_pb2.SPEC_METHOD_NGRAM, max_num_speculative_tokens=8,
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=TARGET.vocab_size))

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


def test_a_hung_drafter_is_cut_off_and_reconnected():
    servicer = HangsOnce()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    client = DrafterClient("d", f"127.0.0.1:{port}", TARGET, backoff_s=(0.05, 0.1),
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
