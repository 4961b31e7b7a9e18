"""Model-free drafters end to end: greedy decoding through the verifier service with
the drafter in its stack, beside plain greedy decoding of the same tiny target."""

from __future__ import annotations

from collections.abc import Callable

from drafter.method import DraftMethod
from specdec.generate import greedy_generate
from tests.loop_thread import LoopThread
from tests.verifier.test_service import (
    VOCAB,
    Stack,
    generate,
    prompts,
    run_concurrently,
    start_msg,
    tiny_target,
)


def decode_with_drafter(name: str, make_method: Callable[[int], DraftMethod], batch: int,
                        seed: int, tokens: int = 48,
                        drafters: list | None = None) -> tuple[list[list[int]], list, list]:
    """(outputs with drafter `name` at K=4, plain greedy outputs, each request's last
    response) for `batch` prompts, each repeated three times so that lookup finds
    something. make_method gets the target's vocabulary size; `drafters`, if given,
    receives the verifier's Load report of its drafters at the end."""
    model = tiny_target()
    loop = LoopThread()
    stack = Stack(loop, model, {name: make_method(VOCAB)})
    try:
        ps = [p * 3 for p in prompts(batch, seed=seed)]
        expected = greedy_generate(model, ps, tokens)
        results = run_concurrently(lambda m: generate(stack.stub, m),
                                   [(start_msg(p, tokens, k=4, drafter=name),) for p in ps])
        if drafters is not None:
            drafters.extend(stack.load().drafters)
        return [t for t, _ in results], expected, [r[-1] for _, r in results]
    finally:
        stack.close()
        loop.close()
