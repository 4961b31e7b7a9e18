"""Tool calling through the OpenAI API: validation, rendering through the chat
template or the generic Hermes prompt, the parser of `<tool_call>` blocks (whole and
streamed), and `required` / named choices enforced by a grammar, exact under
speculation (the same call as plain decoding under that grammar)."""

from __future__ import annotations

import copy
import json
import random

import httpx2
import openai
import pytest

from gateway import tools
from specdec.pb import common_pb2
from specdec.tokenizer import Tokenizer
from tests.gateway.stack import MODEL_NAME
from tests.verifier.test_structured import reference

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "now", "parameters": {"type": "object",
                                  "properties": {"tz": {"enum": ["UTC", "CET"]},
                                                 "exact": {"type": "boolean"}},
                                  "required": ["tz", "exact"]}}}
TOOLS = [WEATHER, CLOCK]
NAMES = {"get_weather", "now"}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SPECS = [{"method": "none"}, {"method": "ngram", "num_speculative_tokens": 4},
         {"method": "draft_model", "num_speculative_tokens": 4}]


def check_arguments(name: str, arguments: str) -> None:
    """The arguments are valid for the function's schema (checked by hand: no jsonschema)."""
    args = json.loads(arguments)
    assert isinstance(args, dict)
    if name == "get_weather":
        assert set(args) == {"city", "unit"}
        assert isinstance(args["city"], str) and len(args["city"]) <= 8
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "now"
        assert set(args) == {"tz", "exact"}
        assert args["tz"] in ("UTC", "CET") and isinstance(args["exact"], bool)


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


# -- the parser -----------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
PARSED = [
    ("Just text, <b>no</b> calls.\n", "Just text, <b>no</b> calls.\n", []),
    (CALL, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n",
     "Let me check.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
      ("get_weather", '{"city": "Rome", "unit": "celsius"}')]),
    # Not calls: invalid JSON, an undeclared function, arguments not an object, unclosed.
    ("a <tool_call>{\"name\": get_weather}</tool_call> b",
     "a <tool_call>{\"name\": get_weather}</tool_call> b", []),
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "now", "arguments": "UTC"}</tool_call>',
     '<tool_call>{"name": "now", "arguments": "UTC"}</tool_call>', []),
    ('ok <tool_call>{"name": "now", "arguments": {', 'ok <tool_call>{"name": "now", "arguments": {',
     []),
    ("ends with <tool_ca", "ends with <tool_ca", []),
    # Text on both sides of a call, and a bad block beside a good one.
    ("Sure: " + CALL + " done", "Sure: done", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("<tool_call>[1]</tool_call>\n" + CALL, "<tool_call>[1]</tool_call>",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
]


@pytest.mark.parametrize("text, content, calls", PARSED)
def test_parser_splits_content_and_calls_however_the_text_is_fed(text, content, calls):
    got_content, got = tools.parse(text, NAMES)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("chatcmpl-tool-") and len(c.id) > 20 for c in got)
    rng = random.Random(len(text))
    for _ in range(20):  # streamed in random pieces: the same content, the same calls
        parser = tools.ToolCallParser(NAMES)
        events, i = [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            events += parser.feed(text[i:i + n])
            i += n
        events += parser.finish()
        streamed = "".join(e for e in events if isinstance(e, str))
        assert streamed == (content or "")
        assert [(e.name, e.arguments) for e in events if isinstance(e, tools.ToolCall)] == calls


def test_parser_holds_back_only_what_may_start_a_call():
    parser = tools.ToolCallParser(NAMES)
    assert parser.feed("Hello <tool") == ["Hello"]  # " <tool" may begin a call
    assert parser.feed("s are") == [" <tools are"]
    assert parser.feed(" " + CALL[:30]) == []
    events = parser.feed(CALL[30:])
    assert [type(e) for e in events] == [tools.ToolCall]
    assert parser.finish() == []


# -- validation and the grammar ---------------------------------------------------------

def test_required_and_named_grammars_admit_only_valid_calls(stack):
    g = stack.grammars
    tok = stack.tokenizer

    def accepts(grammar: str, text: str) -> bool:
        m = g.matcher(g.compile(common_pb2.StructuredOutput(grammar=grammar)))
        n = len(tok.encode(text))
        return m.allowed_drafts(tok.encode(text)) == n and \
            m.allowed_drafts([*tok.encode(text), min(tok.eos_token_ids)]) == n + 1

    good = CALL
    clock = '<tool_call>\n{"name": "now", "arguments": {"tz": "CET", "exact": true}}\n</tool_call>'
    required = tools.from_openai({"tools": TOOLS, "tool_choice": "required"}).grammar()
    assert accepts(required, good) and accepts(required, clock)
    assert accepts(required, good + "\n" + clock)
    assert not accepts(required, "Sure. " + good)  # calls only
    assert not accepts(required, good.replace('"celsius"', '"kelvin"'))
    assert not accepts(required, good.replace("Paris", "Parisian city"))  # maxLength 8
    assert not accepts(required, "")  # at least one call
    single = tools.from_openai({"tools": TOOLS, "tool_choice": "required",
                                "parallel_tool_calls": False}).grammar()
    assert accepts(single, good) and not accepts(single, good + "\n" + clock)
    named = tools.from_openai({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "now"}}}).grammar()
    assert accepts(named, clock) and not accepts(named, good)
    # auto is free text; with parallel_tool_calls false, at most one (valid) call.
    assert tools.from_openai({"tools": TOOLS}).grammar() is None
    assert tools.from_openai({"tools": TOOLS, "tool_choice": "none"}).grammar() is None
    one = tools.from_openai({"tools": TOOLS, "parallel_tool_calls": False}).grammar()
    assert accepts(one, "Let me see.\n" + good) and accepts(one, "No call at all.")
    assert not accepts(one, good + "\n" + clock)


BAD_TOOLS = [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "declared twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
]


@pytest.mark.parametrize("extra, needle", BAD_TOOLS, ids=lambda x: str(x)[:40])
def test_bad_tools_are_400_naming_the_field(client, extra, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                       extra_body=extra)
    assert needle in e.value.body["message"], e.value.body


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}],
     "only assistant messages"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{oops"}}]}],
     "arguments: not JSON"),
    ([{"role": "function", "content": "x", "name": "f"}], "role"),
])
def test_bad_history_is_400_naming_messages(client, messages, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert needle in e.value.body["message"] and e.value.body["param"] in ("messages", "role")


# -- rendering ----------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call-2", "type": "function",
         "function": {"name": "now", "arguments": '{"tz": "CET", "exact": false}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call-2", "content": "14:05"},
]


def rendered(stack, messages, tools_=None) -> str:
    body = {"messages": messages, **({"tools": tools_} if tools_ else {})}
    r = httpx2.post(stack.base_url.removesuffix("/v1") + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return stack.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)


def test_generic_rendering_of_tools_and_history(stack, client):
    text = rendered(stack, HISTORY, TOOLS)
    # SmolLM2's template has no tools section: the generic prompt follows the system text.
    assert stack.tokenizer.render_chat(MESSAGES, tools=TOOLS) == \
        stack.tokenizer.render_chat(MESSAGES)
    system = ("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions"
              " to assist with the user query.")
    assert text.startswith(system)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(CLOCK) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "now", '
            '"arguments": {"tz": "CET", "exact": false}}\n</tool_call><|im_end|>') in text
    # The two tool results: one user turn, as Qwen2.5's template writes them.
    assert text.endswith("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
                         "<tool_response>\n14:05\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    # Without a system message the tools prompt is one; without tools there is none.
    assert rendered(stack, MESSAGES, TOOLS).startswith("<|im_start|>system\n# Tools\n\n")
    assert "<tools>" not in rendered(stack, HISTORY)
    # The chat endpoint takes the same conversation and renders it the same way.
    resp = client.chat.completions.create(model=MODEL_NAME, messages=HISTORY, tools=TOOLS,
                                          max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens == len(stack.tokenizer.encode(text))


# A template with a tools section and tool roles (Qwen2.5's, shortened).
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n{{ m.tool_call_id }}: {{ m.content }}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}<|im_start|>assistant\n")


def test_a_template_with_a_tools_section_renders_them_itself(stack):
    hf = copy.deepcopy(stack.tokenizer.hf)
    hf.chat_template = NATIVE_TEMPLATE
    native = Tokenizer(hf)
    render = lambda messages, fns: native.render_chat(messages, tools=fns)  # noqa: E731
    assert tools.template_renders_tools(render)
    assert not tools.template_renders_tools(
        lambda messages, fns: stack.tokenizer.render_chat(messages, tools=fns))
    history = tools.history([{"tool_calls": None, "tool_call_id": None, **m} for m in HISTORY],
                            native=True)
    text = render(history, tools.from_openai({"tools": TOOLS}).tools())
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather now<|im_end|>")
    assert 'CALL get_weather {"city": "Paris", "unit": "celsius"}' in text
    assert "<|im_start|>tool\ncall-2: 14:05<|im_end|>" in text
    assert "<tool_call>" not in text and "<tool_response>" not in text


# -- generation ---------------------------------------------------------------------------

def want_calls(stack, extra: dict, max_tokens: int
               ) -> tuple[str | None, list[tuple[str, str]], str]:
    """Plain greedy decoding under the request's tool grammar, parsed: (content, calls,
    finish reason)."""
    r = httpx2.post(stack.base_url.removesuffix("/v1") + "/tokenize",
                    json={"messages": MESSAGES, "tools": extra["tools"]})
    prompt = r.json()["tokens"]
    grammar = tools.from_openai(extra).grammar()
    ids = reference(stack.model, stack.grammars, common_pb2.StructuredOutput(grammar=grammar),
                    prompt, max_tokens, stack.tokenizer.eos_token_ids)
    content, calls = tools.parse(stack.tokenizer.decode(ids), NAMES)
    finish = "tool_calls" if ids[-1] in stack.tokenizer.eos_token_ids else "length"
    return content, [(c.name, c.arguments) for c in calls], finish


CHOICES = {
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "required, one call": {"tools": TOOLS, "tool_choice": "required",
                           "parallel_tool_calls": False},
    "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}},
}


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_forced_calls_are_valid_and_exact_under_speculation(stack, client, choice):
    extra = CHOICES[choice]
    content, want, finish = want_calls(stack, extra, 120)
    if choice == "required":
        # The tiny model never stops calling: two whole calls, then max_tokens cuts the
        # third, which stays text.
        assert len(want) == 2 and finish == "length"
        assert content == '<tool_call>\n{"na'
    else:
        assert len(want) == 1 and content is None and finish == "tool_calls"
    if choice == "named":
        assert want[0][0] == "now"
    for name, arguments in want:
        check_arguments(name, arguments)
    for spec in SPECS:
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=120,
            tools=extra["tools"], tool_choice=extra["tool_choice"],
            extra_body={"speculative": spec,
                        **{k: v for k, v in extra.items() if k == "parallel_tool_calls"}})
        choice0 = resp.choices[0]
        assert calls_of(choice0.message) == want, spec
        assert choice0.message.content == content
        assert choice0.finish_reason == finish
        assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-")
                   for c in choice0.message.tool_calls)
        if spec["method"] == "draft_model":
            assert resp.model_extra["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [120, 60])
def test_streamed_tool_calls_reassemble_to_the_whole_reply(client, max_tokens):
    # 120: two calls and a cut one (content); 60: one call, the second cut.
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=max_tokens, n=2, seed=1,
        logprobs=True, tools=TOOLS, tool_choice="required",
        # A static K: without one dynamic K may leave a short reply undrafted.
        extra_body={"speculative": {"method": "draft_model", "num_speculative_tokens": 4}})
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=max_tokens, n=2, seed=1,
        logprobs=True, tools=TOOLS, tool_choice="required", stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculative": {"method": "ngram"}}))
    for index in range(2):
        calls: dict[int, dict] = {}
        content, finish, logprobs = "", None, 0
        for c in chunks:
            for ch in c.choices:
                if ch.index != index:
                    continue
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
                logprobs += len(ch.logprobs.content) if ch.logprobs else 0
                for d in ch.delta.tool_calls or ():
                    if d.index not in calls:  # the first delta of a call: id, type, name
                        assert d.id.startswith("chatcmpl-tool-") and d.type == "function"
                        assert d.function.name and d.function.arguments == ""
                        calls[d.index] = {"name": d.function.name, "arguments": ""}
                    else:
                        assert d.id is None and d.function.name is None
                        calls[d.index]["arguments"] += d.function.arguments
        got = [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)]
        assert sorted(calls) == list(range(len(calls)))
        assert got == calls_of(whole.choices[index].message) and got
        assert content == whole.choices[index].message.content and "</tool" not in content
        assert finish == whole.choices[index].finish_reason == "length"
        assert logprobs == len(whole.choices[index].logprobs.content) > 0
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.model_extra["spec_decode"]["num_accepted_tokens"] > 0


def test_auto_is_free_text_and_none_is_not_parsed(stack, client):
    content = MESSAGES[0]["content"]
    prompt = httpx2.post(stack.base_url.removesuffix("/v1") + "/tokenize",
                         json={"messages": MESSAGES, "tools": TOOLS}).json()["tokens"]
    want, _ = stack.reference(prompt, 24)
    # auto with parallel_tool_calls false runs under a grammar of at most one call, which
    # leaves text without calls as it is.
    for choice, parallel in (("auto", True), ("none", True), ("auto", False)):
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}], tools=TOOLS,
            tool_choice=choice, parallel_tool_calls=parallel, temperature=0, max_tokens=24,
            extra_body={"speculative": {"method": "ngram"}})
        # The tiny random model writes no call: the text is plain decoding's, untouched.
        assert resp.choices[0].message.content == want
        assert resp.choices[0].message.tool_calls is None
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert resp.usage.prompt_tokens == len(prompt)


def test_tool_calls_over_grpc_and_the_sdk(stack):
    """The gRPC API and the SDK call tools as REST does: the same forced calls, whole or
    streamed, the same rendering of a history with a tool result."""
    from specdec.client import Client, InvalidRequestError, ToolCall

    extra = CHOICES["named"]
    content, want, finish = want_calls(stack, extra, 120)
    with Client(stack.grpc_address) as client:
        kw = {"max_tokens": 120, "temperature": 0, "tools": TOOLS,
              "tool_choice": extra["tool_choice"], "speculative": {"method": "ngram"}}
        out = client.chat(MESSAGES, **kw)
        assert [(c.name, c.arguments) for c in out.tool_calls] == want
        assert out.text == (content or "") and out.finish_reason == finish == "tool_calls"
        assert all(c.id.startswith("chatcmpl-tool-") for c in out.tool_calls)
        chunks = list(client.chat(MESSAGES, stream=True, **kw))
        assert [(c.name, c.arguments) for ch in chunks for c in ch.tool_calls] == want
        assert "".join(ch.text for ch in chunks) == (content or "")
        assert chunks[-1].finish_reason == "tool_calls"
        # A history with the call and its result renders as over REST.
        history = [*MESSAGES, {"role": "assistant", "content": "",
                               "tool_calls": out.tool_calls},
                   {"role": "tool", "tool_call_id": out.tool_calls[0].id, "content": "14:05"}]
        rest_history = [*MESSAGES, {"role": "assistant", "content": "",
                                    "tool_calls": [c.to_openai() for c in out.tool_calls]},
                        history[-1]]
        r = httpx2.post(stack.base_url.removesuffix("/v1") + "/tokenize",
                        json={"messages": rest_history, "tools": TOOLS})
        again = client.chat(history, max_tokens=4, temperature=0, tools=TOOLS)
        assert again.usage.prompt_tokens == len(r.json()["tokens"])
        with pytest.raises(InvalidRequestError, match="tool_choice"):
            client.chat(MESSAGES, max_tokens=4, tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": "nope"}})
        with pytest.raises(InvalidRequestError, match=r"tools\[0\].function.parameters"):
            client.chat(MESSAGES, max_tokens=4, tools=[{"type": "function", "function": {
                "name": "f", "parameters": {"type": "array"}}}])
    assert isinstance(out.tool_calls[0], ToolCall)
