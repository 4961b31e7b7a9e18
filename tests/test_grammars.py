"""Grammar compilation as the services run it: off their event loops, bounded in time,
and kept in a cache bounded in bytes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from specdec import structured
from specdec.pb import common_pb2


@pytest.fixture
def grammars(smollm2_dir):
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    return structured.Grammars(tok.hf, tok.vocab_size, tok.eos_token_ids)


def _schema(n: int) -> common_pb2.StructuredOutput:
    props = {f"p{i}_{n}": {"type": "integer"} for i in range(8)}
    return common_pb2.StructuredOutput(json_schema=json.dumps(
        {"type": "object", "properties": props, "required": list(props)}))


def test_compiles_off_the_event_loop(grammars, monkeypatch):
    threads = []
    compile_now = grammars.compile
    monkeypatch.setattr(grammars, "compile",
                        lambda spec, field: threads.append(threading.get_ident())
                        or compile_now(spec, field))

    async def main():
        return threading.get_ident(), await grammars.compile_off_loop(_schema(0), "f")

    loop_thread, compiled = asyncio.run(main())
    assert compiled is not None and threads and threads[0] != loop_thread


def test_a_compile_past_the_time_limit_is_refused_naming_the_field(grammars, monkeypatch):
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(grammars, "compile", lambda spec, field: time.sleep(0.5))
    with pytest.raises(ValueError, match="response_format: took over"):
        asyncio.run(grammars.compile_off_loop(_schema(0), "response_format"))


def test_a_bad_grammar_is_refused_before_it_queues(grammars, monkeypatch):
    monkeypatch.setattr(grammars, "compile", lambda spec, field: pytest.fail("queued"))
    big = common_pb2.StructuredOutput(regex="a" * (structured.MAX_GRAMMAR_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        asyncio.run(grammars.compile_off_loop(big, "f"))


def test_the_cache_of_compiled_grammars_is_bounded_in_bytes(grammars, monkeypatch):
    grammars.compile(_schema(0))
    one = grammars.cache_bytes()
    assert one > 0
    fresh = structured.Grammars(grammars._hf, grammars.vocab_size, grammars.stop_token_ids)
    monkeypatch.setattr(structured, "GRAMMAR_CACHE_BYTES", 3 * one)
    for n in range(12):
        fresh.compile(_schema(n))
    # Twelve would hold about 12 x one; xgrammar evicts once over its limit, so at most
    # about one grammar more than the limit stays.
    assert 0 < fresh.cache_bytes() <= 4 * one
