"""The Drafter service over loopback: a real grpc.aio server and client in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable

import grpc
import pytest
import torch

from drafter.method import Draft, DrafterInfo, DraftMethod
from drafter.ngram import NgramMethod
from drafter.service import serve
from drafter.suffix import SuffixMethod
from specdec.draft_table import table_drafts
from specdec.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.sampling import SamplingParams
from specdec.server import GRPC_OPTIONS, draft_request_bytes
from specdec.tensor_codec import decode_tensor, encode_tensor

Start = drafter_pb2.DraftEntry.Start
Advance = drafter_pb2.DraftEntry.Advance
Free = drafter_pb2.DraftEntry.Free
GREEDY = common_pb2.SamplingParams(temperature=0.0)

LAYERS = [2, 5, 8]
HIDDEN = 16
VOCAB = 50


class RecordingMethod(DraftMethod):
    """Needs hidden states and samples; drafts last token + 1, + 2, ... with one-hot-ish q."""

    name = "recording"

    def __init__(self) -> None:
        self.contexts: dict[Hashable, list[int]] = {}
        self.hidden: list[tuple[torch.Tensor | None, int]] = []
        self.sampling: list[SamplingParams] = []

    def info(self) -> DrafterInfo:
        return DrafterInfo(
            method=common_pb2.SPEC_METHOD_EAGLE3, vocab_size=VOCAB, tokenizer_hash="abc",
            model_name="tiny-head", max_num_speculative_tokens=3, needs_hidden_states=True,
            hidden_state_layers=LAYERS, hidden_size=HIDDEN, hidden_state_dtype=torch.bfloat16,
            target_model_name="tiny-target", returns_probs=True, supports_pipelining=True,
            max_model_len=4096)

    def start(self, key, prompt_ids, output_ids, sampling, max_num_speculative_tokens):
        self.contexts[key] = prompt_ids + output_ids
        self.sampling.append(sampling)

    def advance(self, key, num_drafted, num_accepted, new_token_ids, num_rollback_tokens,
                hidden_states, hidden_start_position):
        ctx = self.contexts[key]
        del ctx[len(ctx) - num_rollback_tokens:]
        ctx.extend(new_token_ids)
        self.hidden.append((hidden_states, hidden_start_position))

    def propose(self, wanted):
        out = {}
        for key, k in wanted.items():
            last = self.contexts[key][-1]
            tokens = [(last + i) % VOCAB for i in range(1, k + 1)]
            probs = torch.full((k, VOCAB), 0.5 / (VOCAB - 1))
            probs[torch.arange(k), tokens] = 0.5
            out[key] = Draft(tokens, probs)
        return out

    def free(self, key):
        self.contexts.pop(key, None)

    def has(self, key):
        return key in self.contexts


@contextlib.asynccontextmanager
async def drafter(method: DraftMethod, **limits: int) -> AsyncIterator[drafter_pb2_grpc.DrafterStub]:
    service = await serve(method, "127.0.0.1:0", **limits)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}", options=GRPC_OPTIONS)
    try:
        yield drafter_pb2_grpc.DrafterStub(channel)
    finally:
        await channel.close()
        await service.stop(grace_s=0)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=30))


async def exchange(call, step: int, *entries: drafter_pb2.DraftEntry) -> drafter_pb2.DraftResponse:
    """The answer to the step's request; bets placed on earlier answers are passed over."""
    await call.write(drafter_pb2.DraftRequest(step=step, entries=entries))
    while True:
        response = await call.read()
        assert response is not grpc.aio.EOF
        if not response.followup:
            return response
        assert response.step < step and not response.proposals


async def ended(call) -> bool:
    """Whether the stream ends with nothing but bets still to read."""
    while (response := await call.read()) is not grpc.aio.EOF:
        if not response.followup:
            return False
    return True


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def hidden_states(rows: int, layers=LAYERS, hidden=HIDDEN, dtype=torch.bfloat16,
                  start: int = 0) -> drafter_pb2.HiddenStates:
    tensor = torch.arange(rows * len(layers) * hidden, dtype=torch.float32)
    tensor = tensor.reshape(rows, len(layers), hidden).to(dtype)
    return drafter_pb2.HiddenStates(tensor=encode_tensor(tensor), layers=layers,
                                    start_position=start)


def test_info_reports_the_method():
    async def main():
        async with drafter(NgramMethod(max_num_speculative_tokens=5, vocab_size=123,
                                       tokenizer_hash="f00")) as stub:
            info = await stub.Info(drafter_pb2.InfoRequest())
        assert info.method == common_pb2.SPEC_METHOD_NGRAM
        assert (info.tokenizer.vocab_size, info.tokenizer.hash) == (123, "f00")
        assert info.max_num_speculative_tokens == 5
        assert not info.needs_hidden_states and not info.returns_probs

        async with drafter(RecordingMethod()) as stub:
            info = await stub.Info(drafter_pb2.InfoRequest())
        assert info.method == common_pb2.SPEC_METHOD_EAGLE3
        assert info.needs_hidden_states and list(info.hidden_state_layers) == LAYERS
        assert info.hidden_size == HIDDEN
        assert info.hidden_state_dtype == common_pb2.DTYPE_BFLOAT16
        assert (info.model_name, info.target_model_name) == ("tiny-head", "tiny-target")
        assert info.returns_probs and info.supports_pipelining and info.max_model_len == 4096

    run(main())


def test_stream_starts_advances_and_frees_with_rounds():
    method = NgramMethod(max_num_speculative_tokens=4)

    async def main():
        async with drafter(method) as stub:
            call = stub.Draft()
            # Start with an immediate proposal (K = 3); round 0.
            r = await exchange(call, 10, drafter_pb2.DraftEntry(seq_id=7, round=0, start=Start(
                prompt_token_ids=[1, 2, 3, 4, 1, 2], sampling=GREEDY, num_speculative_tokens=3)))
            assert r.step == 10 and not r.unknown_seq_ids
            assert [(p.seq_id, p.round, list(p.token_ids)) for p in r.proposals] == [
                (7, 0, [3, 4, 1])]
            assert not r.proposals[0].HasField("probs")
            assert r.draft_time_ms >= 0

            # Two drafts accepted + bonus 9, next K = 8 (capped at 4): round 1, 9 is new.
            r = await exchange(call, 11, drafter_pb2.DraftEntry(seq_id=7, round=1, advance=Advance(
                num_drafted=3, num_accepted=2, new_token_ids=[3, 4, 9], num_speculative_tokens=8)))
            assert r.step == 11 and not r.proposals and not r.unknown_seq_ids

            # A second sequence starts with output tokens (a reconnect at round 5) while
            # the first advances with K = 0: only the second gets a proposal.
            r = await exchange(
                call, 12,
                drafter_pb2.DraftEntry(seq_id=7, round=2, advance=Advance(new_token_ids=[1])),
                drafter_pb2.DraftEntry(seq_id=8, round=5, start=Start(
                    prompt_token_ids=[5, 6, 7], output_token_ids=[8, 5, 6],
                    sampling=GREEDY, num_speculative_tokens=8)))
            assert [(p.seq_id, p.round, list(p.token_ids)) for p in r.proposals] == [
                (8, 5, [7, 8, 5, 6])]  # K capped at 4

            # [1 2 3 4 1 2 3 4 9 1] -> 2 3 4 9; sequence 8 goes away.
            r = await exchange(
                call, 13,
                drafter_pb2.DraftEntry(seq_id=7, round=3, advance=Advance(
                    num_speculative_tokens=4)),
                drafter_pb2.DraftEntry(seq_id=8, free=Free()))
            assert [(p.seq_id, p.round, list(p.token_ids)) for p in r.proposals] == [
                (7, 3, [2, 3, 4, 9])]
            assert method.num_sequences == 1

            await call.done_writing()
            assert await ended(call)
            assert await call.code() == grpc.StatusCode.OK
            # The stream ended cleanly, after its handler freed what it held.
            assert method.num_sequences == 0

    run(main())


def test_unknown_and_out_of_sync_sequences_are_reported():
    method = NgramMethod()

    async def main():
        async with drafter(method) as stub:
            call = stub.Draft()
            r = await exchange(
                call, 1,
                drafter_pb2.DraftEntry(seq_id=1, round=0, start=Start(
                    prompt_token_ids=[4, 5, 4], sampling=GREEDY)),
                drafter_pb2.DraftEntry(seq_id=2, round=3, advance=Advance(
                    new_token_ids=[1], num_speculative_tokens=2)),
                drafter_pb2.DraftEntry(seq_id=3, free=Free()))
            assert list(r.unknown_seq_ids) == [2]  # Free of an unknown sequence is fine
            assert not r.proposals

            # Round 2 after round 0: a step went missing, so the state is dropped.
            r = await exchange(call, 2, drafter_pb2.DraftEntry(seq_id=1, round=2, advance=Advance(
                new_token_ids=[5], num_speculative_tokens=2)))
            assert list(r.unknown_seq_ids) == [1] and not r.proposals
            assert method.num_sequences == 0
            # ... and stays dropped, even for the round that would have come next.
            r = await exchange(call, 3, drafter_pb2.DraftEntry(seq_id=1, round=1, advance=Advance(
                new_token_ids=[5], num_speculative_tokens=2)))
            assert list(r.unknown_seq_ids) == [1]

            # Re-starting it (as the verifier does after unknown_seq_ids) works again.
            r = await exchange(call, 4, drafter_pb2.DraftEntry(seq_id=1, round=3, start=Start(
                prompt_token_ids=[4, 5, 4], output_token_ids=[5], num_speculative_tokens=2)))
            assert [(p.seq_id, p.round, list(p.token_ids)) for p in r.proposals] == [
                (1, 3, [4, 5])]
            await call.done_writing()

    run(main())


def test_streams_do_not_see_each_others_sequences():
    method = NgramMethod()

    async def main():
        async with drafter(method) as stub:
            a, b = stub.Draft(), stub.Draft()
            start = drafter_pb2.DraftEntry(seq_id=1, round=0, start=Start(
                prompt_token_ids=[1, 2, 1], num_speculative_tokens=2))
            r = await exchange(a, 1, start)
            assert list(r.proposals[0].token_ids) == [2, 1]
            # Stream b never started sequence 1.
            r = await exchange(b, 1, drafter_pb2.DraftEntry(seq_id=1, round=1, advance=Advance(
                new_token_ids=[3], num_speculative_tokens=2)))
            assert list(r.unknown_seq_ids) == [1]
            # b's own sequence 1 has another context; a's is untouched by it.
            r = await exchange(b, 2, drafter_pb2.DraftEntry(seq_id=1, round=0, start=Start(
                prompt_token_ids=[7, 8, 9, 7], num_speculative_tokens=2)))
            assert list(r.proposals[0].token_ids) == [8, 9]
            r = await exchange(a, 2, drafter_pb2.DraftEntry(seq_id=1, round=1, advance=Advance(
                new_token_ids=[2], num_speculative_tokens=2)))
            assert list(r.proposals[0].token_ids) == [1, 2]  # [1 2 1 2]: "1 2" at 0 -> 1 2
            assert method.num_sequences == 2

            # b frees its sequence 1; a's survives.
            r = await exchange(b, 3, drafter_pb2.DraftEntry(seq_id=1, free=Free()))
            assert method.num_sequences == 1
            await a.done_writing()
            await b.done_writing()
            assert await ended(a) and await ended(b)

    run(main())


def test_cancelled_stream_frees_its_sequences():
    method = NgramMethod()

    async def main():
        async with drafter(method) as stub:
            keep, gone = stub.Draft(), stub.Draft()
            for call in (keep, gone):
                await exchange(call, 1, *[
                    drafter_pb2.DraftEntry(seq_id=s, start=Start(prompt_token_ids=[1, 2, 3]))
                    for s in (1, 2, 3)])
            assert method.num_sequences == 6
            gone.cancel()
            await wait_until(lambda: method.num_sequences == 3)
            # The other stream still works.
            r = await exchange(keep, 2, drafter_pb2.DraftEntry(seq_id=2, round=1, advance=Advance(
                new_token_ids=[1], num_speculative_tokens=2)))
            assert list(r.proposals[0].token_ids) == [2, 3] and not r.unknown_seq_ids
            keep.cancel()
            await wait_until(lambda: method.num_sequences == 0)

    run(main())


def test_hidden_states_and_probs_travel():
    method = RecordingMethod()

    async def main():
        async with drafter(method) as stub:
            call = stub.Draft()
            sampling = common_pb2.SamplingParams(temperature=0.7, top_k=20, seed=3)
            r = await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=4, start=Start(
                prompt_token_ids=[10, 11, 12], sampling=sampling, max_num_speculative_tokens=3)))
            assert not r.proposals  # K = 0 until the first Advance
            (got,) = method.sampling
            assert got.temperature == pytest.approx(0.7)  # float32 on the wire
            assert (got.top_k, got.top_p, got.min_p, got.seed) == (20, 1.0, 0.0, 3)

            r = await exchange(call, 2, drafter_pb2.DraftEntry(seq_id=4, round=1, advance=Advance(
                new_token_ids=[13], hidden_states=hidden_states(4, start=0),
                num_speculative_tokens=5)))
            (proposal,) = r.proposals
            assert list(proposal.token_ids) == [14, 15, 16]  # K = 5 capped at 3
            probs = decode_tensor(proposal.probs.dense, expected_dtype=torch.float32,
                                  expected_shape=[3, VOCAB])
            assert probs[torch.arange(3), [14, 15, 16]].tolist() == [0.5, 0.5, 0.5]
            hidden, start = method.hidden[-1]
            assert hidden.dtype == torch.bfloat16 and list(hidden.shape) == [4, 3, HIDDEN]
            assert torch.equal(hidden.float().flatten()[:5], torch.arange(5.0)) and start == 0

            # An Advance that only asks for a proposal carries no positions, so no states.
            r = await exchange(call, 3, drafter_pb2.DraftEntry(seq_id=4, round=2, advance=Advance(
                num_speculative_tokens=1)))
            assert [list(p.token_ids) for p in r.proposals] == [[14]]
            assert method.hidden[-1] == (None, 0)
            await call.done_writing()

    run(main())


def test_a_step_in_several_messages_is_answered_once_in_several():
    """A request split over continued messages is applied whole and answered once; an
    answer larger than a message comes in parts, the last with the rest of its fields."""
    method = RecordingMethod()

    async def main():
        async with drafter(method, part_bytes=1000) as stub:
            call = stub.Draft()
            starts = [drafter_pb2.DraftEntry(seq_id=i, start=Start(
                prompt_token_ids=[i], num_speculative_tokens=3)) for i in range(3)]
            await call.write(drafter_pb2.DraftRequest(step=1, entries=starts[:2], continued=True))
            await call.write(drafter_pb2.DraftRequest(step=1, entries=[starts[2]]))
            parts = [await call.read()]
            while parts[-1].continued:
                parts.append(await call.read())
            # One proposal's dense q ([3, 50] float32) is 600 bytes: one a message.
            assert len(parts) == 3 and {p.step for p in parts} == {1}
            assert [[list(q.token_ids) for q in p.proposals] for p in parts] == \
                [[[1, 2, 3]], [[2, 3, 4]], [[3, 4, 5]]]
            assert parts[-1].draft_time_ms > 0 and not parts[0].draft_time_ms
            # The next step is the next answer: nothing else was sent.
            r = await exchange(call, 2, drafter_pb2.DraftEntry(seq_id=0, free=Free()))
            assert r.step == 2 and not r.continued
            await call.done_writing()
            assert await ended(call)

    run(main())


def test_a_request_past_max_request_bytes_is_refused_by_grpc():
    """Info's max_request_bytes is what the server takes: a larger message ends its
    stream with RESOURCE_EXHAUSTED before it is read; the next stream is served."""
    method = RecordingMethod()

    async def main():
        async with drafter(method, max_request_bytes=5000) as stub:
            assert (await stub.Info(drafter_pb2.InfoRequest())).max_request_bytes == 5000
            call = stub.Draft()
            await call.write(drafter_pb2.DraftRequest(step=1, entries=[drafter_pb2.DraftEntry(
                seq_id=1, start=Start(prompt_token_ids=[1] * 5000))]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            call = stub.Draft()
            r = await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=1, start=Start(
                prompt_token_ids=[1] * 2000, num_speculative_tokens=1)))
            assert [list(p.token_ids) for p in r.proposals] == [[2]]
            await call.done_writing()
        # Unset, it is what a Start for the method's context can need.
        async with drafter(method) as stub:
            info = await stub.Info(drafter_pb2.InfoRequest())
        assert info.max_request_bytes == draft_request_bytes(4096, VOCAB)

    run(main())


async def _expect_invalid(stub, method, *requests: drafter_pb2.DraftRequest) -> str:
    """Send requests until the stream is aborted; the details of its status."""
    call = stub.Draft()
    for request in requests:
        await call.write(request)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while await call.read() is not grpc.aio.EOF:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The aborted stream's sequences are gone too.
    await wait_until(lambda: not method.contexts)
    return err.value.details()


def _started(seq_id: int = 1) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(step=1, entries=[drafter_pb2.DraftEntry(
        seq_id=seq_id, start=Start(prompt_token_ids=[1, 2, 3]))])


def _advance(step: int, **advance) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(step=step, entries=[
        drafter_pb2.DraftEntry(seq_id=9, start=Start(prompt_token_ids=[1])),
        drafter_pb2.DraftEntry(seq_id=1, round=1, advance=Advance(new_token_ids=[4], **advance)),
    ])


@pytest.mark.parametrize(("requests", "field", "problem"), [
    ([_started(), _advance(2, hidden_states=hidden_states(1, hidden=HIDDEN + 1))],
     "entries[1].advance.hidden_states.tensor", "does not match expected [-1, 3, 16]"),
    ([_started(), _advance(2, hidden_states=hidden_states(1, dtype=torch.float32))],
     "entries[1].advance.hidden_states.tensor", "expected torch.bfloat16"),
    ([_started(), _advance(2, hidden_states=hidden_states(1, layers=[2, 5, 9]))],
     "entries[1].advance.hidden_states.layers", "[2, 5, 9] differ"),
    ([_started(), _advance(2)],
     "entries[1].advance.hidden_states", "missing"),
    ([_started(), drafter_pb2.DraftRequest(step=2, entries=[drafter_pb2.DraftEntry(seq_id=1)])],
     "entries[0]", "no kind set"),
    ([_started(), _started(2)], "step", "1 is not greater than the stream's previous step 1"),
    ([_started(), drafter_pb2.DraftRequest(step=2, continued=True), _advance(3)],
     "step", "3 continues step 2"),
    ([drafter_pb2.DraftRequest(step=1, entries=[drafter_pb2.DraftEntry(seq_id=1, start=Start(
        prompt_token_ids=[1, VOCAB]))])],
     "entries[0].start.prompt_token_ids", f"must be in [0, {VOCAB}), got {VOCAB}"),
    ([drafter_pb2.DraftRequest(step=1, entries=[drafter_pb2.DraftEntry(seq_id=1, start=Start(
        prompt_token_ids=[1], sampling=common_pb2.SamplingParams(top_p=1.5)))])],
     "entries[0].start.sampling", "top_p must be in (0, 1]"),
    ([_started(), _advance(2, num_drafted=1, num_accepted=2,
                           hidden_states=hidden_states(1))],
     "entries[1].advance.num_accepted", "exceeds num_drafted"),
])
def test_malformed_requests_abort_with_invalid_argument(requests, field, problem):
    method = RecordingMethod()

    async def main():
        async with drafter(method) as stub:
            details = await _expect_invalid(stub, method, *requests)
            assert details.startswith(f"{field}: "), details
            assert problem in details, details
            # The server is still fine for the next stream.
            call = stub.Draft()
            r = await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=1, start=Start(
                prompt_token_ids=[1], num_speculative_tokens=1)))
            assert [list(p.token_ids) for p in r.proposals] == [[2]]
            await call.done_writing()

    run(main())


def test_rollback_past_the_context_is_invalid():
    method = NgramMethod()

    async def main():
        async with drafter(method) as stub:
            call = stub.Draft()
            await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=1, start=Start(
                prompt_token_ids=[1, 2])))
            await call.write(drafter_pb2.DraftRequest(step=2, entries=[drafter_pb2.DraftEntry(
                seq_id=1, round=1, advance=Advance(num_rollback_tokens=3, new_token_ids=[5]))]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while (await call.read()).followup:  # the table placed after the Start
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("entries[0].advance: num_rollback_tokens 3")
            await wait_until(lambda: method.num_sequences == 0)

    run(main())


def test_bets_on_a_fully_accepted_proposal_answer_its_outcome():
    """After each answer the drafter bets on the outcome "every draft accepted, then its
    own next guess" (a followup message, after the answer); the Advance carrying exactly
    that outcome is answered with the bet's drafts, and any other outcome as usual.
    Ngram matching single tokens only places bets: it has no longer matches to list in
    a table (the tests after)."""

    async def main():
        async with drafter(NgramMethod(max_n=1, max_num_speculative_tokens=4)) as stub:
            call = stub.Draft()
            prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
            answer = await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=7, round=0, start=Start(
                prompt_token_ids=prompt, sampling=GREEDY, num_speculative_tokens=3)))
            drafts = list(answer.proposals[0].token_ids)
            assert drafts == [3, 4, 1]
            followup = await call.read()
            assert followup.followup and followup.step == 1 and not followup.proposals
            (bet,) = followup.bets
            assert (bet.seq_id, bet.round) == (7, 1)
            assert list(bet.new_token_ids) == [*drafts, 2]  # the guess after 3 4 1 is 2
            assert list(bet.token_ids) == [3, 4, 1]

            answer = await exchange(call, 2, drafter_pb2.DraftEntry(seq_id=7, round=1, advance=Advance(
                num_drafted=3, num_accepted=3, new_token_ids=list(bet.new_token_ids),
                num_speculative_tokens=2)))
            assert [(p.round, list(p.token_ids)) for p in answer.proposals] == [
                (1, list(bet.token_ids)[:2])]  # the bet's drafts, cut to this K
            followup = await call.read()
            assert followup.followup and followup.bets[0].round == 2

            # An outcome nobody bet on (the first draft rejected, 9 instead) is drafted
            # from the real context.
            answer = await exchange(call, 3, drafter_pb2.DraftEntry(seq_id=7, round=2, advance=Advance(
                num_drafted=2, num_accepted=0, new_token_ids=[9], num_speculative_tokens=3)))
            assert not answer.proposals  # 9 never occurred before: nothing to copy
            await call.done_writing()
            assert await ended(call)

    run(main())


def test_suffix_answers_the_advance_by_its_table():
    """Suffix lists the outcomes whose match is two tokens or longer; it answers the
    Advance with the table's entry, and an outcome the table does not list with no
    proposal, though drafting from the context would propose some: the verifier took
    none from the table, and the next table is on what it verified."""

    async def main():
        async with drafter(SuffixMethod(max_num_speculative_tokens=4)) as stub:
            call = stub.Draft()
            prompt = [1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2]
            answer = await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=7, round=0, start=Start(
                prompt_token_ids=prompt, sampling=GREEDY, num_speculative_tokens=3)))
            assert answer.bets_follow and list(answer.proposals[0].token_ids) == [3, 4, 1]
            (table,) = (await call.read()).tables
            assert (table.round, list(table.proposal), table.copy_unlisted) == (1, [3, 4, 1], False)

            # Every draft accepted, then 2: the context ends in 1 2 3 4 1 2 as the
            # prompt began.
            entry = table_drafts(table, [3, 4, 1, 2])
            assert entry == [3, 4, 5, 1]
            answer = await exchange(call, 2, drafter_pb2.DraftEntry(seq_id=7, round=1, advance=Advance(
                num_drafted=3, num_accepted=3, new_token_ids=[3, 4, 1, 2], num_speculative_tokens=4)))
            assert [list(p.token_ids) for p in answer.proposals] == [entry]
            (table,) = (await call.read()).tables
            assert (table.round, list(table.proposal)) == (2, entry)

            # The first draft rejected and 5 instead: 5 never followed 2, so the table
            # has no drafts for it, though 5 alone is followed by 1 2 3 in the context.
            assert table_drafts(table, [5]) == []
            own = SuffixMethod(max_num_speculative_tokens=4)
            own.start(0, [*prompt, 3, 4, 1, 2, 5], [], SamplingParams(), 4)
            assert own.propose({0: 4})[0].token_ids == [1, 2, 3]
            answer = await exchange(call, 3, drafter_pb2.DraftEntry(seq_id=7, round=2, advance=Advance(
                num_drafted=4, num_accepted=0, new_token_ids=[5], num_speculative_tokens=4)))
            assert not answer.proposals and answer.bets_follow
            (table,) = (await call.read()).tables
            assert (table.round, list(table.proposal)) == (3, [])
            await call.done_writing()
            assert await ended(call)

    run(main())


def test_ngram_places_a_table_of_every_outcome_and_answers_by_it():
    """Ngram lists every outcome's drafts in a DraftTable (after a proposal, and after an
    answer with none) and answers the Advance with the entry of its outcome; with
    one-token matches the verifier copies after the tokens the table does not list, and
    with nothing longer to match the drafter places single bets instead."""

    async def main():
        async with drafter(NgramMethod(min_n=2, max_num_speculative_tokens=4)) as stub:
            call = stub.Draft()
            prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
            answer = await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=7, round=0, start=Start(
                prompt_token_ids=prompt, sampling=GREEDY, num_speculative_tokens=3)))
            assert answer.bets_follow and list(answer.proposals[0].token_ids) == [3, 4, 1]
            followup = await call.read()
            assert followup.followup and not followup.bets
            (table,) = followup.tables
            assert (table.seq_id, table.round, list(table.proposal)) == (7, 1, [3, 4, 1])
            assert (table.k, table.copy_unlisted) == (4, False)
            # Each accepted count: the context's last token 2, 3, 4 or 1 has one follower.
            assert list(table.group_sizes) == [1, 1, 1, 1]
            assert table_drafts(table, [3, 4, 1, 2]) == [3, 4, 1, 2]
            assert table_drafts(table, [3, 9]) == []  # 3 then 9 was never seen

            # Two drafts accepted, then 1: the answer is the table's entry, cut to K = 2.
            entry = table_drafts(table, [3, 4, 1])
            answer = await exchange(call, 2, drafter_pb2.DraftEntry(seq_id=7, round=1, advance=Advance(
                num_drafted=3, num_accepted=2, new_token_ids=[3, 4, 1], num_speculative_tokens=2)))
            assert [list(p.token_ids) for p in answer.proposals] == [entry[:2]] == [[2, 3]]
            (table,) = (await call.read()).tables
            # An outcome that leaves nothing to copy: no proposal, and still a table.
            answer = await exchange(call, 3, drafter_pb2.DraftEntry(seq_id=7, round=2, advance=Advance(
                num_drafted=2, num_accepted=0, new_token_ids=[9], num_speculative_tokens=3)))
            assert table_drafts(table, [9]) == [] and not answer.proposals
            assert answer.bets_follow
            (table,) = (await call.read()).tables
            assert (table.round, list(table.proposal), list(table.group_sizes)) == (3, [], [0])
            # Advanced without being asked for drafts (the verifier runs it plain this
            # step): still a table, for the step that drafts again.
            answer = await exchange(call, 4, drafter_pb2.DraftEntry(seq_id=7, round=3, advance=Advance(
                num_drafted=0, num_accepted=0, new_token_ids=[1], num_speculative_tokens=0)))
            assert answer.bets_follow and not answer.proposals
            (table,) = (await call.read()).tables
            assert table.round == 4 and table_drafts(table, [2]) == [3, 4, 1, 9]
            await call.done_writing()
            assert await ended(call)

        for max_n, tables in ((4, True), (1, False)):
            method = NgramMethod(min_n=1, max_n=max_n, max_num_speculative_tokens=4)
            async with drafter(method) as stub:
                call = stub.Draft()
                await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=7, round=0, start=Start(
                    prompt_token_ids=[1, 2, 3, 1, 2], sampling=GREEDY,
                    num_speculative_tokens=3)))
                followup = await call.read()
                assert bool(followup.tables) == tables and bool(followup.bets) != tables
                assert all(t.copy_unlisted for t in followup.tables)
                await call.done_writing()
                assert await ended(call)

    run(main())


def test_a_method_that_needs_hidden_states_places_no_bets():
    async def main():
        async with drafter(RecordingMethod()) as stub:
            call = stub.Draft()
            answer = await exchange(call, 1, drafter_pb2.DraftEntry(seq_id=1, round=0, start=Start(
                prompt_token_ids=[1, 2, 3], sampling=GREEDY, num_speculative_tokens=2)))
            assert answer.proposals
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF  # no followup before the end

    run(main())
