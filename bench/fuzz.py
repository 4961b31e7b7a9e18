"""Fuzzing the gateway's public APIs: no input a client can send may give a 5xx, a hang
or a dropped connection, and the stack must answer a reference request the same after.

REST (/v1/chat/completions, /v1/completions, /tokenize, /detokenize): hypothesis draws a
small valid body whose fields are each left out, valid, or hostile (a wrong type, a
number out of range or past 64 bits, NaN, a huge string or list, lone surrogates, an
unknown field, a method the deployment does not run, a bad grammar, a context past the
model's length), or raw bytes (broken JSON, invalid UTF-8, nesting past any parser's
recursion). gRPC (Gateway.Generate and Gateway.Chat): messages drawn field by field from
the proto descriptors (every scalar to its type's extremes, enum values no one defined,
long repeated fields), serialized, or mutated into bytes the protobuf parser refuses.

A case's verdict: "ok" (a whole reply or stream), "refused" (a 4xx with an OpenAI error
body, or a gRPC status for the client's error with a message), or "fail" with why: a
5xx, a refusal without its error body, a dropped connection, a stream without its end,
no answer within the timeout.

    python -m bench.fuzz [--cases 2000] [--out bench/results/fuzz]

starts `make run`'s stack (specdec.launch's local services) on free ports, runs the
cases against it, and writes cases, refusals, failures (each with its case) and every
service's RSS before and after to JSON and markdown. `tests/gateway/test_fuzz.py` runs a
bounded, derandomized set against the test stack in `make test`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import httpx2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from specdec.pb import gateway_pb2

RESULTS = Path(__file__).parent / "results"
MODEL_NAME_PLACEHOLDER = "{model}"

# -- REST cases -------------------------------------------------------------------


@dataclass(frozen=True)
class RestCase:
    path: str  # under the server's root: /v1/chat/completions, /tokenize, ...
    body: bytes

    def describe(self) -> str:
        text = self.body[:1500].decode("utf-8", "backslashreplace")
        return f"POST {self.path} {text}{'...' if len(self.body) > 1500 else ''}"


class Raw:
    """JSON text placed in a body as it is (nesting too deep for json.dumps to write)."""

    def __init__(self, text: str):
        self.text = text


def dumps(body: object) -> bytes:
    """JSON of body with every Raw's text spliced in where it stands."""
    raws: list[str] = []

    def mark(value: object) -> object:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
    return text.encode("utf-8", "surrogatepass")


DEEP = 100_000  # past Python's recursion limit and any reasonable parser's
BIG_INTS = [2**31, 2**32, 2**53 + 1, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**31), -1, 0, 10**40]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1e-30]

# Text a tokenizer, a template or a grammar compiler may choke on: lone surrogates,
# NULs, control characters, very long words.
odd_text = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(categories=("Cs", "Cc", "Co", "Cn", "Zs")), max_size=20),
    st.sampled_from(["", "\x00", "\ud800", "<|im_end|>", "<tool_call>", "{{ raise }}",
                     "a" * 20_000, "\u202e" * 50, "🦀" * 2_000]),
)
hostile = st.one_of(
    st.none(), st.booleans(), st.sampled_from(BIG_INTS), st.sampled_from(ODD_FLOATS),
    st.integers(), st.floats(), odd_text,
    st.lists(st.integers(-5, 200_000), max_size=6),
    st.dictionaries(odd_text, st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
    st.just(list(range(20_000))),
    st.just(Raw("[" * DEEP + "]" * DEEP)),
    st.just(Raw('{"a":' * 5_000 + "1" + "}" * 5_000)),
)


def _or_hostile(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, hostile)


small_schema = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.just({"type": "array", "items": {"type": "string"}, "maxItems": 2}),
    st.just({"type": "nope"}),
    st.just({"$ref": "#/definitions/missing"}),
    st.just({"type": "string", "pattern": "("}),
    st.just(Raw('{"type":"object","properties":' * 2_000 + "{}" + "}" * 2_000)),
    hostile,
)
grammar_fields = {
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "yaml"}]),
        st.builds(lambda s, strict: {"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": s, "strict": strict}},
                  small_schema, st.sampled_from([True, False, None, "yes"]))),
    "guided_regex": st.sampled_from(["[a-c]{1,3}", "(", "a*" * 500, "\\d+"]),
    "guided_choice": st.lists(odd_text, max_size=3),
    "guided_json": small_schema,
    "guided_grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= ", "x ::= y"]),
    "structured_outputs": st.one_of(st.fixed_dictionaries({"choice": st.lists(odd_text, max_size=3)}),
                                    st.fixed_dictionaries({"regex": st.just("[0-9]+")}),
                                    st.fixed_dictionaries({"json": small_schema})),
}
speculative = st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["none", "ngram", "suffix", "draft_model", "eagle", "eagle3",
                               "medusa", "", "NGRAM"]),
    "num_speculative_tokens": st.one_of(st.integers(0, 9), st.sampled_from(BIG_INTS)),
    "drafter": odd_text,
    "auto": st.booleans(),
})
sampling_fields = {
    "model": st.sampled_from([MODEL_NAME_PLACEHOLDER, "other", "", "a" * 5_000]),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 60),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**32),
    "n": st.integers(1, 3),
    "best_of": st.integers(1, 3),
    "stop": st.one_of(odd_text, st.lists(odd_text, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 50_000), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 50_000).map(str), st.floats(-100, 100),
                                  max_size=4),
    "min_tokens": st.integers(0, 6),
    "bad_words": st.lists(odd_text, max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 50_000), max_size=4),
    "speculative": speculative,
    "priority": st.integers(-5, 5),
    "cache_salt": odd_text,
    "user": odd_text,
    "timeout": st.floats(0.5, 30),
    **grammar_fields,
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
     "content": st.one_of(odd_text, st.just(None),
                          st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                          "text": odd_text}), max_size=2))},
    optional={"tool_call_id": odd_text, "name": odd_text,
              "tool_calls": st.lists(st.fixed_dictionaries({
                  "id": odd_text, "type": st.just("function"),
                  "function": st.fixed_dictionaries({"name": odd_text,
                                                     "arguments": odd_text})}), max_size=2)})
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]),
                              "function": st.fixed_dictionaries(
                                  {"name": st.one_of(st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
                                                     odd_text)},
                                  optional={"description": odd_text, "parameters": small_schema})})
chat_fields = {
    **sampling_fields,
    "messages": st.lists(_or_hostile(message), max_size=4),
    "max_completion_tokens": st.integers(1, 6),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 25),
    "tools": st.one_of(st.lists(tool, max_size=3), st.just([{"type": "function", "function": {
        "name": f"f{i}"}} for i in range(300)])),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                             st.fixed_dictionaries({"type": st.just("function"), "function":
                                                    st.fixed_dictionaries({"name": odd_text})})),
    "parallel_tool_calls": st.booleans(),
    "echo": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(odd_text, hostile, max_size=2),
    "return_tokens_as_token_ids": st.booleans(),
}
completion_fields = {
    **sampling_fields,
    "prompt": st.one_of(odd_text, st.lists(st.integers(-3, 60_000), max_size=8),
                        st.lists(odd_text, max_size=3),
                        st.lists(st.lists(st.integers(0, 1000), max_size=4), max_size=3),
                        st.just("word " * 5_000), st.just(list(range(5_000)))),
    "logprobs": st.integers(0, 25),
    "echo": st.booleans(),
    "suffix": odd_text,
}
tokenize_fields = {
    "model": sampling_fields["model"], "prompt": odd_text,
    "messages": chat_fields["messages"], "tools": chat_fields["tools"],
    "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
}
detokenize_fields = {"model": sampling_fields["model"],
                     "tokens": st.lists(st.integers(-5, 200_000), max_size=8)}
ENDPOINTS = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                             chat_fields),
    "/v1/completions": ({"prompt": "Once upon a time", "max_tokens": 4}, completion_fields),
    "/tokenize": ({"prompt": "hello"}, tokenize_fields),
    "/detokenize": ({"tokens": [1, 2, 3]}, detokenize_fields),
}


def _body(path: str, tame: bool) -> st.SearchStrategy[dict]:
    """A body for path: its fields each left out or valid, and when not tame also hostile,
    with unknown fields beside them. Tame bodies are the ones that run (hostile values
    in some of some thirty fields leave few that a server accepts), and so reach what
    runs after validation: templates, grammars, sampling, streaming."""
    base, fields = ENDPOINTS[path]
    chosen = st.fixed_dictionaries({}, optional={k: v if tame else _or_hostile(v)
                                                 for k, v in fields.items()})
    unknown = st.dictionaries(st.text(min_size=1, max_size=12), hostile,
                              max_size=0 if tame else 2)
    return st.builds(lambda c, u, drop: {**{k: v for k, v in base.items() if k not in drop},
                                         **u, **c},
                     chosen, unknown, st.sets(st.sampled_from(sorted(base)), max_size=1))


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"{not json", b"null", b"[]", b"1e999999", b'"x"',
                     b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
                     b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
                     b'{"prompt": "a", "max_tokens": 2, "max_tokens": "x"}',
                     b"[" * DEEP + b"]" * DEEP, b'{"a":' * 200_000,
                     b'{"prompt": "' + b"a" * (5 << 20) + b'"}']),
)


def rest_cases(model: str) -> st.SearchStrategy[RestCase]:
    def body(path: str) -> st.SearchStrategy[RestCase]:
        shaped = st.booleans().flatmap(lambda tame: _body(path, tame)).map(
            lambda b: dumps(_with_model(b, model)))
        return st.one_of(shaped, shaped, shaped, raw_bodies).map(lambda b: RestCase(path, b))
    return st.sampled_from(sorted(ENDPOINTS)).flatmap(body)


def _with_model(body: dict, model: str) -> dict:
    if body.get("model") == MODEL_NAME_PLACEHOLDER:
        return {**body, "model": model}
    return body


# -- gRPC cases -------------------------------------------------------------------


@dataclass(frozen=True)
class GrpcCase:
    method: str  # Generate or Chat
    payload: bytes  # the request message as sent (not always one a parser accepts)

    def describe(self) -> str:
        cls = REQUESTS[self.method]
        try:
            text = str(cls.FromString(self.payload)).replace("\n", " ")[:1500]
        except Exception:  # noqa: BLE001 - the payload is meant to be unparsable at times
            text = f"unparsable bytes {self.payload[:60]!r}"
        return f"{self.method} {text}"


REQUESTS = {"Generate": gateway_pb2.GatewayGenerateRequest, "Chat": gateway_pb2.ChatRequest}
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# Small values are what make a request run; the extremes are what break one.
_SMALL = st.integers(0, 8)


def _scalar(f: FieldDescriptor, tame: bool) -> st.SearchStrategy:
    """Values of a scalar field; tame: the small ones a request runs with."""
    if tame:
        if f.enum_type is not None:
            return st.sampled_from([v.number for v in f.enum_type.values])
        if f.type in _INT_RANGES:
            return _SMALL
        if f.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            return st.floats(0, 1, width=32 if f.type == FieldDescriptor.TYPE_FLOAT else 64)
        if f.type == FieldDescriptor.TYPE_STRING:
            return st.text(max_size=10)
    if f.type in _INT_RANGES:
        lo, hi = _INT_RANGES[f.type]
        if f.enum_type is not None:
            return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]),
                             st.integers(-3, 40))
        return st.one_of(_SMALL, _SMALL, st.sampled_from([lo, hi, lo + 1, hi - 1, 0]),
                         st.integers(lo, hi))
    if f.type == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]),
                         st.integers(-(2**31), 2**31 - 1))
    if f.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        width = 32 if f.type == FieldDescriptor.TYPE_FLOAT else 64
        return st.one_of(st.floats(0, 2, width=width), st.sampled_from(ODD_FLOATS),
                         st.floats(width=width))
    if f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if f.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=20), odd_text.filter(_encodable))
    return st.binary(max_size=64)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def messages_of(cls, tame: bool = False, depth: int = 0) -> st.SearchStrategy:
    """Instances of the protobuf message class cls, each field present or not, drawn by
    its type (nested messages to a depth of 3); tame: small values, short lists."""
    fields: dict[str, st.SearchStrategy] = {}
    for f in cls.DESCRIPTOR.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            fields[f.name] = st.dictionaries(_scalar(key, tame), _scalar(value, tame),
                                             max_size=4)
            continue
        if f.message_type is not None:
            if depth >= 3:
                continue
            elem = messages_of(GetMessageClass(f.message_type), tame, depth + 1)
        else:
            elem = _scalar(f, tame)
        if f.is_repeated and tame:
            fields[f.name] = st.lists(elem, max_size=3)
        elif f.is_repeated:
            fields[f.name] = st.one_of(st.lists(elem, max_size=4),
                                       st.lists(elem, min_size=300, max_size=300).filter(bool)
                                       if f.message_type is None else st.lists(elem, max_size=6))
        else:
            fields[f.name] = elem
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: _build(cls, values))


def _build(cls, values: dict):
    msg = cls()
    for name, value in values.items():
        f = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            target.update(value)
        elif f.is_repeated:
            if f.message_type is not None:
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.extend(value)
        elif f.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


def _valid_start(method: str, model: str):
    """A request that runs: a short prompt, a few tokens."""
    if method == "Chat":
        return gateway_pb2.ChatRequest(model=model, messages=[gateway_pb2.ChatMessage(
            role="user", content="Hi")], sampling={"max_tokens": 4})
    return gateway_pb2.GatewayGenerateRequest(model=model, text="Once upon a time",
                                              sampling={"max_tokens": 4})


def grpc_cases(model: str) -> st.SearchStrategy[GrpcCase]:
    def case(method: str) -> st.SearchStrategy[GrpcCase]:
        cls = REQUESTS[method]

        def merged(drawn) -> bytes:
            msg = _valid_start(method, model)
            msg.MergeFrom(drawn)  # the drawn fields over a request that runs
            return msg.SerializeToString()

        serialized = st.booleans().flatmap(lambda tame: messages_of(cls, tame)).map(merged)
        # Bytes the parser must refuse: invalid UTF-8 in a string field, a truncated
        # message, noise.
        broken = st.one_of(
            st.binary(max_size=64),
            serialized.map(lambda b: b[: max(1, len(b) // 2)]),
            st.just(b"\x0a\x04\xff\xfe\xfd\xfc"),  # field 1 (model, a string): not UTF-8
        )
        return st.one_of(serialized, serialized, serialized, broken).map(
            lambda payload: GrpcCase(method, payload))
    return st.sampled_from(sorted(REQUESTS)).flatmap(case)


# -- verdicts ---------------------------------------------------------------------


@dataclass
class Verdict:
    kind: str  # ok, refused, fail
    status: str  # the HTTP status or gRPC code
    why: str = ""


def check_rest(client: httpx2.Client, root: str, case: RestCase, timeout_s: float) -> Verdict:
    try:
        with client.stream("POST", root + case.path, content=case.body, timeout=timeout_s,
                           headers={"content-type": "application/json"}) as r:
            text = r.read().decode("utf-8", "replace")
    except httpx2.TimeoutException:
        return Verdict("fail", "timeout", f"no answer within {timeout_s} s")
    except httpx2.HTTPError as e:
        return Verdict("fail", "dropped", f"{type(e).__name__}: {e}")
    status = str(r.status_code)
    if r.status_code == 504 and _asks_timeout(case.body):
        return Verdict("refused", status + " its own timeout")
    if r.status_code >= 500:
        return Verdict("fail", status, text[:300])
    if r.status_code >= 400:
        try:
            err = json.loads(text)["error"]
            ok = isinstance(err["message"], str) and err["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        return Verdict("refused", status) if ok else Verdict(
            "fail", status, f"no OpenAI error body: {text[:200]}")
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return Verdict("fail", status, f"a stream without its end: {text[-200:]}")
        if any('"error"' in e and e.lstrip().startswith('{"error"') for e in events):
            return Verdict("refused", status + " stream error")
        return Verdict("ok", status)
    try:
        json.loads(text)
    except ValueError:
        return Verdict("fail", status, f"not JSON: {text[:200]}")
    return Verdict("ok", status)


def _asks_timeout(body: bytes) -> bool:
    """Whether the body sets the request's own `timeout` (a 504 is then its answer)."""
    try:
        return "timeout" in json.loads(body)
    except (ValueError, TypeError, RecursionError):
        return False


# A client's error, each said with a message; anything else (INTERNAL, UNKNOWN,
# UNAVAILABLE, DEADLINE_EXCEEDED, ...) is the server's failure.
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED}


def check_grpc(channel: grpc.Channel, case: GrpcCase, timeout_s: float) -> Verdict:
    call = channel.unary_stream(f"/specdec.v1.Gateway/{case.method}",
                                request_serializer=None, response_deserializer=None)
    try:
        for _ in call(case.payload, timeout=timeout_s):
            pass
    except grpc.RpcError as e:
        code = e.code()
        if code in CLIENT_CODES and e.details():
            return Verdict("refused", code.name)
        return Verdict("fail", code.name, e.details() or "no message")
    return Verdict("ok", "OK")


# -- the long run -----------------------------------------------------------------


@dataclass
class Tally:
    cases: Counter = field(default_factory=Counter)  # kind -> count
    statuses: Counter = field(default_factory=Counter)  # "api status" -> count
    failures: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, api: str, case, verdict: Verdict) -> None:
        with self.lock:
            self.cases[f"{api} {verdict.kind}"] += 1
            self.statuses[f"{api} {verdict.status}"] += 1
            if verdict.kind == "fail" and len(self.failures) < 50:
                self.failures.append({"api": api, "status": verdict.status, "why": verdict.why,
                                      "case": case.describe()})


def fuzz(strategy: st.SearchStrategy, check, num_cases: int, tally: Tally, api: str, *,
         derandomize: bool = False) -> None:
    """num_cases cases of strategy through check, every verdict tallied (nothing raised:
    the run counts failures rather than stopping at the first). derandomize: the same
    cases every run (a test's)."""
    @settings(max_examples=num_cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=derandomize)
    @given(strategy)
    def one(case) -> None:
        tally.add(api, case, check(case))
    one()


def reference_reply(client: httpx2.Client, base: str, model: str) -> str:
    r = client.post(base + "/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Name three colours."}],
        "temperature": 0, "max_tokens": 12})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def render(result: dict) -> str:
    lines = ["# Fuzzing the gateway's APIs", "",
             f"`{result['command']}`: {result['cases_per_api']} cases per API against "
             f"`make run`'s stack ({result['model']}, replies capped at "
             f"{result['max_tokens']} tokens), {result['seconds']:.0f} s.", "",
             "| API | cases | ok | refused (4xx / client status) | fail (5xx, hang, drop) |",
             "| --- | --- | --- | --- | --- |"]
    for api in ("rest", "grpc"):
        c = {k: result["cases"].get(f"{api} {k}", 0) for k in ("ok", "refused", "fail")}
        lines.append(f"| {api} | {sum(c.values())} | {c['ok']} | {c['refused']} | {c['fail']} |")
    lines += ["", "Statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(result["statuses"].items())),
              "", "| service | RSS before (MiB) | after (MiB) | growth |", "| --- | --- | --- | --- |"]
    for name, (before, after) in sorted(result["rss_kb"].items()):
        lines.append(f"| {name} | {before / 1024:.0f} | {after / 1024:.0f} | "
                     f"{(after - before) / max(before, 1):+.1%} |")
    lines += ["", f"Reference reply identical after the run: {result['reference_identical']}."]
    if result["failures"]:
        lines += ["", "Failures (first 50):", ""]
        lines += [f"- {f['api']} {f['status']}: {f['why'][:120]} — `{f['case'][:200]}`"
                  for f in result["failures"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.serving import _wait_drafters, rss_kb
    from specdec.launch import EAGLE3_HEAD, LocalStack, local_services, on_free_ports
    from specdec.models.prepare import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="cases per API (REST, gRPC)")
    ap.add_argument("--apis", default="rest,grpc", help="which to fuzz: rest, grpc or both")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="a case's answer, at most")
    ap.add_argument("--max-tokens", type=int, default=16,
                    help="the gateway's --max-tokens-limit for the run")
    ap.add_argument("--out", type=Path, default=RESULTS / "fuzz")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/specdec-fuzz"))
    args = ap.parse_args(argv)

    model_dir = default_model_dir()
    env = {"SPECDEC_MODEL_ROOT": str(model_dir.parent), "SPECDEC_MODEL": model_dir.name,
           "EAGLE3_HEAD": str(EAGLE3_HEAD), **os.environ}
    # Replies capped as the test stack caps them: a case that runs then costs seconds, and
    # one past the cap is refused (400), so that a long reply is never taken for a hang.
    services = [replace(s, argv=(*s.argv, "--max-tokens-limit", str(args.max_tokens)))
                if s.name == "gateway" else s for s in local_services(environ=env)]
    services, ports = on_free_ports(services)
    gateway = next(s for s in services if s.name == "gateway")
    drafter = gateway.argv[gateway.argv.index("--speculative-method") + 1]
    stack = LocalStack(services, args.log_dir, log=lambda s: print("  " + s, flush=True))
    stop = threading.Event()
    t0 = time.perf_counter()
    try:
        stack.start(timeout_s=600)
        threading.Thread(target=stack.supervise, args=(stop,), daemon=True).start()
        _wait_drafters(f"127.0.0.1:{ports[50051]}", {drafter} - {"none"})
        root = f"http://127.0.0.1:{ports[8000]}"
        with httpx2.Client() as client:
            model = client.get(root + "/v1/models").json()["data"][0]["id"]
            reference = reference_reply(client, root + "/v1", model)
            before = {n: rss_kb(p.pid) for n, p in stack.procs.items()}
            tally = Tally()
            apis = args.apis.split(",")
            if "rest" in apis:
                fuzz(rest_cases(model), lambda c: check_rest(client, root, c, args.timeout_s),
                     args.cases, tally, "rest")
            if "grpc" in apis:
                with grpc.insecure_channel(f"127.0.0.1:{ports[50050]}") as channel:
                    fuzz(grpc_cases(model), lambda c: check_grpc(channel, c, args.timeout_s),
                         args.cases, tally, "grpc")
            after = {n: rss_kb(p.pid) for n, p in stack.procs.items()}
            identical = reference_reply(client, root + "/v1", model) == reference
    finally:
        stop.set()
        stack.stop()
    result = {"command": "python -m bench.fuzz " + " ".join(sys.argv[1:] if argv is None else argv), "model": model_dir.name,
              "cases_per_api": args.cases, "max_tokens": args.max_tokens, "seconds": time.perf_counter() - t0,
              "cases": dict(tally.cases), "statuses": dict(tally.statuses),
              "failures": tally.failures,
              "rss_kb": {n: [before[n], after[n]] for n in before},
              "reference_identical": identical}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = render(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    fails = sum(v for k, v in tally.cases.items() if k.endswith(" fail"))
    return 1 if fails or not identical else 0


if __name__ == "__main__":
    raise SystemExit(main())
