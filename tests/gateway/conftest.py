"""Fixtures of the gateway tests: an event loop on a thread for the in-process
services, the tiny float64 target that speaks the default model's tokenizer, a
whole deployment of it per module (plain by default; a module may define its
own `stack`) and an OpenAI client of that deployment."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.stack import GatewayStack, tiny_target


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from specdec.tokenizer import Tokenizer

    return tiny_target(Tokenizer.from_dir(smollm2_dir))


@pytest.fixture(scope="module")
def stack(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, default_method="none")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
