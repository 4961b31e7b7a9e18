"""The REST API's structured-output fields, as vLLM's OpenAI server takes them, into
one `StructuredOutput` (specdec/structured.py compiles and enforces it):

- `response_format`: {"type": "json_object"}, {"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}}, or {"type": "text"} (none);
- `structured_outputs`: {"json": schema, "regex": ..., "choice": [...], "grammar":
  ..., "json_object": true}, exactly one of them;
- the older aliases `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (and `guided_decoding_backend`, which may only name xgrammar or auto).

At most one of these may constrain a request. Errors are ValueError with the field's
name as `param`.
"""

from __future__ import annotations

from typing import Any

from specdec.pb import common_pb2
from specdec.structured import StructuredOutputError, from_kind, from_kinds, schema_text

_BACKENDS = (None, "", "auto", "xgrammar")
# structured_outputs keys that would shape the grammar in ways this server does not
# implement (refused, never ignored).
_UNSUPPORTED_OPTIONS = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                        "disable_additional_properties", "disable_fallback")


def _from_response_format(rf: Any) -> common_pb2.StructuredOutput | None:
    where = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise StructuredOutputError(f"{where}: an object with a type", where)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise StructuredOutputError(f"{where}.json_schema: an object with a schema",
                                        f"{where}.json_schema")
        if js.get("strict", True) is not True:
            # Schemas compile strict (no properties past the schema's): a non-strict one
            # would be served as if it were strict.
            raise StructuredOutputError(f"{where}.json_schema.strict: only strict schemas are "
                                        f"supported (omit it or send true)",
                                        f"{where}.json_schema.strict")
        return common_pb2.StructuredOutput(
            json_schema=schema_text(js["schema"], f"{where}.json_schema.schema"))
    raise StructuredOutputError(f"{where}.type: one of text, json_object, json_schema "
                                f"(got {kind!r})", f"{where}.type")


def _from_structured_outputs(so: Any) -> common_pb2.StructuredOutput | None:
    where = "structured_outputs"
    if not isinstance(so, dict):
        raise StructuredOutputError(f"{where}: an object", where)
    for key in _UNSUPPORTED_OPTIONS:
        if so.get(key) not in (None, False):
            raise StructuredOutputError(f"{where}.{key}: not supported by this server (it "
                                        f"would change the output, so it is refused rather "
                                        f"than ignored)", f"{where}.{key}")
    if so.get("backend") not in _BACKENDS:
        raise StructuredOutputError(f"{where}.backend: this server uses xgrammar",
                                    f"{where}.backend")
    return from_kinds(so, where, (*_UNSUPPORTED_OPTIONS, "backend"))


def from_openai(extra: dict[str, Any]) -> tuple[common_pb2.StructuredOutput | None, str | None]:
    """The request's grammar and the field it came from, (None, None) for free text."""
    found: list[tuple[common_pb2.StructuredOutput, str]] = []
    if extra.get("guided_decoding_backend") not in _BACKENDS:
        raise StructuredOutputError("guided_decoding_backend: this server uses xgrammar",
                                    "guided_decoding_backend")
    if extra.get("response_format") is not None:
        spec = _from_response_format(extra["response_format"])
        if spec is not None:
            found.append((spec, "response_format"))
    if extra.get("structured_outputs") is not None:
        spec = _from_structured_outputs(extra["structured_outputs"])
        if spec is not None:
            found.append((spec, "structured_outputs"))
    for alias, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if extra.get(alias) is not None:
            found.append((from_kind(kind, extra[alias], alias), alias))
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise StructuredOutputError(f"{found[1][1]}: one structured output per request "
                                    f"(got {names})", found[1][1])
    return found[0] if found else (None, None)
