"""Several choices of one request (`n`): the generations they run as, and their deltas
merged as they come. The REST and gRPC front ends share these."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from gateway.types import Delta, GenerationRequest
from specdec.pb import common_pb2

# Choices per request: each runs as its own sequence in the verifier, so n is bounded
# like any other list a request may carry.
MAX_CHOICES = 64


def choice_requests(requests: list[GenerationRequest], n: int) -> list[GenerationRequest]:
    """n choices of each request, in order. Choice i of a seeded request draws from
    seed + i (as vLLM seeds them), so choices differ yet each is reproducible; its
    request id gets "-i" (the first keeps the id when n is 1)."""
    if n == 1:
        return requests
    out = []
    for req in requests:
        for i in range(n):
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(req.sampling)
            if sampling.HasField("seed"):
                sampling.seed = (sampling.seed + i) % 2**64
            out.append(replace(req, sampling=sampling, request_id=f"{req.request_id}-{i}"))
    return out


async def merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of several generations as they come, tagged with the choice index.
    Closing this closes them all (their verifier streams are cancelled)."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for d in stream:
                await queue.put((i, d, None))
        except Exception as e:  # noqa: BLE001 (handed to the reader, which raises it)
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                left -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
