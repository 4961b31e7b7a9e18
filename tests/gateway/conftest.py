"""Fixtures of the gateway tests: an event loop on a thread for the in-process
services, and the tiny float64 target that speaks the default model's tokenizer."""

from __future__ import annotations

import pytest

from tests.gateway.stack import tiny_target
from tests.loop_thread import LoopThread


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from specdec.tokenizer import Tokenizer

    return tiny_target(Tokenizer.from_dir(smollm2_dir))
