"""Limits on what one request may carry: stop strings (their number and length), the
lists of token ids, and the size of a gRPC API message; each refused naming the field,
the service serving on. And the heavy per-request work kept off the event loop."""

from __future__ import annotations

import openai
import pytest

from specdec.client import Client, InvalidRequestError, SpecdecError
from tests.gateway.stack import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("extra, field", [
    ({"stop": [f"s{i}" for i in range(33)]}, "stop: 33 stop strings"),
    ({"stop": "x" * 1025}, "stop: a stop string is over"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids: 1025 entries"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias: .*1024"),
])
def test_lists_past_the_limits_are_400_naming_the_field(client, extra, field):
    stop = extra.pop("stop", None)
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       stop=stop, extra_body=extra or None)
    # At the limit it is served.
    ok = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                        stop=[f"s{i}" for i in range(32)])
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_the_grpc_api_takes_no_message_larger_than_a_rest_body(stack):
    limit = stack.gateway.config.limits.max_body_bytes
    with Client(stack.grpc_address, max_retries=0) as client:
        with pytest.raises(SpecdecError, match="RESOURCE_EXHAUSTED"):
            client.generate("x" * (limit + 1024), max_tokens=2)
        assert client.generate("Hello", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(InvalidRequestError, match="stop: 33 stop strings"):
            client.generate("Hello", max_tokens=2, stop=[f"s{i}" for i in range(33)])


def test_parsing_and_tokenizing_run_off_the_event_loop(stack, client, monkeypatch):
    """A large body's parse and its chat template would stall every stream if they ran on
    the gateway's event loop: they run on worker threads (REST and gRPC)."""
    import threading

    seen: list[str] = []
    tokenizer = stack.gateway.tokenizer
    render = tokenizer.apply_chat_template

    def recording(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", recording)
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    with Client(stack.grpc_address) as sdk:
        sdk.chat(MESSAGES, max_tokens=2)
    assert len(seen) == 2 and "test-loop" not in seen  # LoopThread's name
