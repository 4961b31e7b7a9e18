"""OpenAI tool calling in the Hermes format, the one SmolLM2 and Qwen were trained on:
the model calls a function by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Pure functions and one small parser, wired in by openai_api.py:

- `from_openai`: the request's `tools`, `tool_choice` and `parallel_tool_calls`,
  checked (ToolError naming the field) into a `ToolRequest`;
- rendering: a chat template that renders `tools=` itself gets them (and the history's
  tool messages as they are); any other gets a Hermes-style system prompt listing the
  functions, assistant tool calls as `<tool_call>` blocks and tool results as user
  turns of `<tool_response>` blocks, as Qwen2.5's template writes them;
- `ToolRequest.grammar`: for `required` and a named function, an EBNF grammar (from
  xgrammar's structural tags) that admits only calls whose arguments are valid for
  the function's parameters schema; it travels as any structured output does, so it
  is exact under speculation;
- `ToolCallParser`: the output's `<tool_call>` blocks into OpenAI tool calls,
  incrementally, so a streamed reply and a whole one split the text the same way.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from specdec.structured import error_text

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Tools one request may declare: each is rendered into the prompt and compiled into the
# grammar of its arguments.
MAX_TOOLS = 128
_CHOICES = ("none", "auto", "required")

# Qwen2.5's tool prompt (its chat template's text), for templates without a tools section.
_SYSTEM_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                "tags:\n<tools>")
_SYSTEM_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]  # JSON schema of the arguments, an object
    arguments_grammar: str = ""  # EBNF of the arguments (_arguments_grammar)

    def as_tool(self) -> dict:
        """OpenAI's shape, which chat templates and the system prompt take."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    # "named": the function `named` must be called, once.
    choice: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True  # False: at most one call

    @property
    def parses(self) -> bool:
        # tool_choice none: the tools are still in the prompt (vLLM's default, its
        # --exclude-tools-when-tool-choice-none is off) but the output stays text.
        return self.choice != "none"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def tools(self) -> list[dict]:
        return [f.as_tool() for f in self.functions]

    def grammar(self) -> str | None:
        """EBNF (xgrammar's dialect) the output must follow, or None where it is free:
        `required` is one or more calls ("\\n" between them) and nothing else, a named
        choice exactly one call of that function; `auto` with parallel_tool_calls false
        is free text with at most one call, which then ends the output."""
        import xgrammar as xgr  # noqa: PLC0415 (a native library, loaded on first use)
        from xgrammar import structural_tag as st  # noqa: PLC0415

        def tag(f: Function) -> st.TagFormat:
            return st.TagFormat(begin=f'{OPEN}\n{{"name": "{f.name}", "arguments": ',
                                content=st.GrammarFormat(grammar=f.arguments_grammar),
                                end="}\n" + CLOSE)

        if self.choice == "named":
            fmt = tag(next(f for f in self.functions if f.name == self.named))
        elif self.choice == "required":
            fmt = st.TagsWithSeparatorFormat(tags=[tag(f) for f in self.functions],
                                             separator="\n", at_least_one=True,
                                             stop_after_first=not self.parallel)
        elif self.choice == "auto" and not self.parallel:
            fmt = st.TriggeredTagsFormat(triggers=[OPEN],
                                         tags=[tag(f) for f in self.functions],
                                         stop_after_first=True)
        else:
            return None
        return str(xgr.Grammar.from_structural_tag(xgr.StructuralTag(format=fmt)))

    def grammar_field(self) -> str:
        """The request field a grammar comes from, for error messages."""
        return "tool_choice" if self.choice != "auto" else "parallel_tool_calls"


def constrain(tool_request: ToolRequest | None, sampling, structured_field: str | None
              ) -> str | None:
    """Put the request's tool grammar (if its choice constrains the output) into
    `sampling` (common.SamplingParams); returns the field the structured output now
    comes from. ToolError where the request also asked for a structured output."""
    grammar = tool_request.grammar() if tool_request is not None else None
    if grammar is None:
        return structured_field
    source = tool_request.grammar_field()
    if structured_field is not None:
        what = {"named": f"a named function ({tool_request.named})",
                "required": '"required"'}.get(tool_request.choice, "false")
        raise ToolError(f"{structured_field}: a structured output cannot be combined with "
                        f"{source} {what}, which constrains the output to tool calls itself",
                        structured_field)
    sampling.structured_output.grammar = grammar
    return source


def from_openai(extra: Mapping[str, Any]) -> ToolRequest | None:
    """The request's tools (None without any); ToolError naming the field."""
    tools = extra.get("tools")
    choice = extra.get("tool_choice")
    parallel = extra.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls: true or false", "parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools: a list of {\"type\": \"function\", \"function\": {...}}",
                        "tools")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ToolError(f"tools: {len(tools)} tools, over this server's limit of {MAX_TOOLS}",
                        "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools or ()))
    names = [f.name for f in functions]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise ToolError(f"tools[{i}].function.name: {name!r} is declared twice", "tools")
        seen.add(name)
    named = None
    if choice is None:
        mode = "auto"  # OpenAI's default with tools (and no effect without)
    elif isinstance(choice, str) and choice in _CHOICES:
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        mode, named = "named", choice["function"]["name"]
        if named not in names:
            raise ToolError(f"tool_choice: names function {named!r}, which tools does not "
                            f"declare (declared: {', '.join(names) or 'none'})", "tool_choice")
    else:
        raise ToolError('tool_choice: "none", "auto", "required" or {"type": "function", '
                        '"function": {"name": ...}}', "tool_choice")
    if not functions:
        if mode in ("required", "named"):
            raise ToolError(f"tool_choice: {mode} needs tools", "tool_choice")
        return None
    return ToolRequest(functions, mode, named, parallel is not False)


def _function(tool: Any, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolError(f"{where}.type: only \"function\" tools are supported", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function: an object with a name", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name: 1 to 64 of a-z, A-Z, 0-9, _ and - (got "
                        f"{name!r})", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description: a string", "tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}  # OpenAI: no parameters at all
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters: a JSON Schema of an object (arguments "
                        f"are an object)", "tools")
    params = {"type": "object", **params}  # {} is any object, not any JSON value
    return Function(name, description, params,
                    _arguments_grammar(params, f"{where}.function.parameters"))


def _arguments_grammar(schema: dict, where: str) -> str:
    """EBNF of JSON valid for `schema`, as json.dumps writes it (", " and ": ", no other
    whitespace), as the calls a Hermes model learnt from were written: free whitespace
    lets a model loop on blank space (the tiny test models do), and a fixed layout is
    more text the grammar forces, which is drafted for free. ToolError for a schema
    xgrammar does not take."""
    import xgrammar as xgr  # noqa: PLC0415

    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                strict_mode=True))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ToolError(f"{where}: {error_text(e)}", "tools") from None


# -- rendering ----------------------------------------------------------------------

def template_renders_tools(render) -> bool:
    """Whether a chat template has a tools section: `render(messages, tools)` -> text,
    with tools and without. A template that has one also renders the history's tool
    calls and tool messages itself (Qwen2.5, Hermes, Llama 3.1 do)."""
    probe = Function("specdec_probe_function", None, {"type": "object", "properties": {}})
    messages = [{"role": "user", "content": "hi"}]
    try:
        return probe.name in render(messages, [probe.as_tool()]) \
            and probe.name not in render(messages, None)
    except Exception:  # noqa: BLE001 (a template that fails on tools has no tools section)
        return False


def history(messages: Sequence[dict], native: bool) -> list[dict]:
    """Chat messages ({"role", "content": str, "tool_calls"?, "tool_call_id"?}) as the
    template gets them. `native` (the template renders tools): as vLLM passes them, with
    each call's arguments parsed into an object. Otherwise an assistant's calls become
    `<tool_call>` blocks after its text, and a run of tool messages one user turn of
    `<tool_response>` blocks. ToolError (param "messages") for a malformed call."""
    out: list[dict] = []
    responses = False  # out[-1] is a user turn of tool responses
    for i, m in enumerate(messages):
        calls = [_history_call(c, f"messages[{i}].tool_calls[{j}]")
                 for j, c in enumerate(m.get("tool_calls") or ())]
        if calls and m["role"] != "assistant":
            raise ToolError(f"messages[{i}].tool_calls: only assistant messages make tool "
                            f"calls", "messages")
        if native:
            msg = {k: v for k, v in m.items() if v is not None and k != "tool_calls"}
            if calls:
                msg["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                      "function": {"name": name, "arguments": args}}
                                     for c, name, args in calls]
            out.append(msg)
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif calls:
            blocks = [f"{OPEN}\n{_call_json(name, args)}\n{CLOSE}" for _, name, args in calls]
            text = m["content"]
            out.append({"role": "assistant",
                        "content": "\n".join([text, *blocks] if text else blocks)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
        responses = not native and m["role"] == "tool"
    return out


def _history_call(call: Any, where: str) -> tuple[dict, str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(f"{where}: {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                        f"\"arguments\"}}}}", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolError(f"{where}.function.arguments: not JSON", "messages") from None
    return call, fn["name"], args


def _call_json(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def with_system_prompt(messages: list[dict], functions: Sequence[Function]) -> list[dict]:
    """The generic tools prompt, after the system message's text or as a new one."""
    listing = "".join("\n" + json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    prompt = _SYSTEM_HEAD + listing + _SYSTEM_TAIL
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        text = first["content"]
        return [{**first, "content": f"{text}\n\n{prompt}" if text else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


# -- parsing ------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def finish_reason(reason: str | None, calls: int) -> str | None:
    """"tool_calls" for an output that ended on its own after calling; a truncated one
    keeps "length", so the client knows it is cut."""
    return "tool_calls" if calls and reason == "stop" else reason


class ToolCallParser:
    """One choice's output, fed as it comes, into events: content text (str) and
    ToolCall. A `<tool_call>` block whose JSON is an object with a declared function's
    "name" and an object "arguments" is a call; any other block stays content, as does
    one the output never closes. Whitespace next to a call is dropped (the "\\n" between
    calls), except that text resuming after a call keeps its own leading space; text
    that could begin a block is held back until it is known not to. Content is the
    same however the text is split into feeds."""

    def __init__(self, names: Collection[str]):
        self.names = frozenset(names)
        self.calls = 0
        self._pending = ""  # text not yet resolved: a possible block or its beginning
        self._inside = False  # _pending starts with OPEN
        self._space = ""  # whitespace after content, dropped if a call follows
        self._after_call = False  # drop whitespace until the next content
        self._said = False  # content came before: text after a call keeps its spacing
        self._events: list[str | ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        while True:
            if not self._inside:
                i = self._pending.find(OPEN)
                if i < 0:
                    keep = _open_prefix(self._pending)
                    self._content(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                self._content(self._pending[:i])
                self._pending = self._pending[i:]
                self._inside = True
            j = self._pending.find(CLOSE, len(OPEN))
            if j < 0:
                break
            end = j + len(CLOSE)
            block, self._pending = self._pending[:end], self._pending[end:]
            self._inside = False
            call = self._call(block[len(OPEN):j])
            if call is None:
                self._content(block)
            else:
                self._space = ""
                self._after_call = True
                self.calls += 1
                self._events.append(call)
        return self._take()

    def step(self, text: str, last: bool) -> list[str | ToolCall]:
        """A streamed delta's events: `text` fed, and the rest too when it is the last."""
        return self.feed(text) + (self.finish() if last else [])

    def finish(self) -> list[str | ToolCall]:
        """The rest, at the end of the output."""
        self._content(self._pending)
        self._pending, self._inside = "", False
        if self._space and not self._after_call:  # trailing whitespace of content only
            self._events.append(self._space)
            self._space = ""
        return self._take()

    def _take(self) -> list[str | ToolCall]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if self._after_call and not self._said:
            # Calls first: the whitespace after them leads nothing.
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            self._events.append(self._space + body)
            self._space = text[len(body):]
            self._said, self._after_call = True, False
        else:
            self._space += text

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            return None
        return ToolCall(f"chatcmpl-tool-{uuid.uuid4().hex}", obj["name"],
                        json.dumps(args, ensure_ascii=False))


def _open_prefix(text: str) -> int:
    """Length of the longest end of `text` that begins OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parse(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """A whole output: (content, or None where it is only calls; the calls)."""
    parser = ToolCallParser(names)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return (content or None) if calls else content, calls
