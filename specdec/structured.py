"""Structured outputs: a request's grammar (JSON schema, any JSON object, regex,
choice, EBNF) compiled by xgrammar against the target's tokenizer, and the
per-sequence matcher the verifier steps through drafts.

The wire form is `common.StructuredOutput` inside SamplingParams, so the gateway's
REST and gRPC APIs and the verifier carry it alike. The gateway compiles a request's
grammar once to refuse a bad one with a 400 naming the field; the verifier compiles
it again (cached) for the matcher.

Under speculation (verifier/engine): before the forward, a sequence's drafts are
walked through its matcher and cut at the first token the grammar forbids, since
the target could never accept it; after the forward, row j of its block (the
position after drafts 1..j) gets the grammar's mask in that state, so the target
distribution every position is verified against is exactly the one plain decoding
under the grammar samples from; after sampling, the matcher accepts what was
emitted. The walk accepts drafts and rolls them back, so the matcher only ever
holds emitted tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.json_depth import parse_json
from specdec.pb import common_pb2

if TYPE_CHECKING:  # torch loads with the first mask, not with the SDK that imports this
    import torch

# Longest choice list, and largest grammar text, a request may carry: a grammar is
# compiled on the serving path, and its size bounds the work.
MAX_CHOICES = 1024
MAX_GRAMMAR_BYTES = 256 * 1024
# Bytes of compiled grammars kept for reuse (xgrammar's cache, least recently used out):
# unbounded, every distinct schema a client sends would grow the process for good.
GRAMMAR_CACHE_BYTES = 64 * 1024 * 1024
# Compiles run off the services' event loops (a 400-property schema took 0.5 s, and a
# stream beside it stalled as long), one at a time (the compiler is not shared between
# threads), each given at most this long.
COMPILE_TIMEOUT_S = 10.0


# vLLM's names for the kinds of grammar (its `structured_outputs` keys).
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def schema_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise StructuredOutputError(f"{where}: a JSON Schema (object or JSON text)", where)


def _choices(value: Any, where: str) -> common_pb2.Choices:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise StructuredOutputError(f"{where}: a list of strings", where)
    return common_pb2.Choices(choices=value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise StructuredOutputError(f"{where}: a string", where)
    return value


def from_kind(kind: str, value: Any, where: str) -> common_pb2.StructuredOutput:
    """One grammar from vLLM's field names (KINDS); StructuredOutputError naming `where`."""
    if kind == "json":
        return common_pb2.StructuredOutput(json_schema=schema_text(value, where))
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(f"{where}: true or absent", where)
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "choice":
        return common_pb2.StructuredOutput(choice=_choices(value, where))
    return common_pb2.StructuredOutput(**{kind: _text(value, where)})


def from_kinds(fields: Mapping[str, Any], where: str,
               other_keys: Collection[str] = ()) -> common_pb2.StructuredOutput | None:
    """vLLM's `structured_outputs` object: at most one of KINDS set (None: none is);
    `other_keys` are keys the caller handles itself. StructuredOutputError naming the
    field."""
    unknown = sorted(set(fields) - set(KINDS) - set(other_keys))
    if unknown:
        raise StructuredOutputError(f"{where}.{unknown[0]}: unknown field",
                                    f"{where}.{unknown[0]}")
    given = [k for k in KINDS if fields.get(k) not in (None, False)]
    if len(given) > 1:
        raise StructuredOutputError(f"{where}: exactly one of {', '.join(KINDS)} (got "
                                    f"{', '.join(given)})", where)
    return from_kind(given[0], fields[given[0]], f"{where}.{given[0]}") if given else None


def _regex_escape(text: str) -> str:
    # xgrammar's regex dialect (ECMAScript-like): escape every metacharacter.
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """What xgrammar compiles for a StructuredOutput. kind: json_schema (text: the
    schema), json_object (text empty: xgrammar's built-in JSON grammar), regex (a choice
    list arrives as the regex of its alternatives) or grammar (EBNF); where: the request
    field it came from, which errors name. Both verifier engines compile from this, so
    the grammar a request gets does not depend on the engine."""

    kind: str
    text: str
    where: str


def grammar_source(spec: common_pb2.StructuredOutput,
                   field: str = "structured_output") -> GrammarSource:
    """The spec's grammar text, checked short of compiling; ValueError naming
    `field`.<kind>."""
    which = spec.WhichOneof("kind")
    if which is None:
        raise ValueError(f"{field}: names no grammar (json_schema, json_object, regex, "
                         f"choice or grammar)")
    where = f"{field}.{which}"
    if which == "json_object":
        if not spec.json_object:
            raise ValueError(f"{where}: must be true when set")
        return GrammarSource("json_object", "", where)
    if which == "json_schema":
        _check_size(where, spec.json_schema)
        schema = parse_json(spec.json_schema, where)
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{where}: a JSON Schema is an object or a boolean")
        return GrammarSource("json_schema", spec.json_schema, where)
    if which == "choice":
        choices = list(spec.choice.choices)
        if not choices:
            raise ValueError(f"{where}: must list at least one choice")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"{where}: at most {MAX_CHOICES} choices")
        _check_size(where, "".join(choices))
        return GrammarSource("regex", "|".join(f"({_regex_escape(x)})" for x in choices),
                             where)
    text = getattr(spec, which)  # regex or grammar
    _check_size(where, text)
    return GrammarSource(which, text, where)


class Grammars:
    """Compiles StructuredOutput specs for one tokenizer; thread-safe, with a cache.

    `tokenizer` is a Hugging Face tokenizer; `vocab_size`
    the model's (it may exceed the tokenizer's: padded rows are never allowed);
    `stop_token_ids` the ids that end a sequence, which the grammar allows once it is
    complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler = None  # built on first use: it reads the whole vocabulary
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def _compiler_now(self):
        import xgrammar as xgr  # noqa: PLC0415 (a native library, loaded on first use)

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._xgr = xgr
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                 cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        return self._compiler

    def compile(self, spec: common_pb2.StructuredOutput, field: str = "structured_output"):
        """The compiled grammar; ValueError naming `field`.<kind> for a bad one."""
        source = grammar_source(spec, field)
        try:
            with self._lock:
                c = self._compiler_now()
                if source.kind == "json_object":
                    return c.compile_builtin_json_grammar()
                if source.kind == "json_schema":
                    # vLLM's xgrammar backend compiles a schema with these options by
                    # default, which the vLLM engine's exactness rests on.
                    return c.compile_json_schema(source.text, any_whitespace=True,
                                                 strict_mode=True)
                if source.kind == "regex":
                    return c.compile_regex(source.text)
                return c.compile_grammar(source.text)
        except RuntimeError as e:
            # xgrammar's parse errors: keep the message, drop its source location.
            raise ValueError(f"{source.where}: {error_text(e)}") from None

    async def compile_off_loop(self, spec: common_pb2.StructuredOutput,
                               field: str = "structured_output"):
        """`compile` on the compiling thread, for an event loop; ValueError naming `field`
        for a bad grammar, or one that takes over COMPILE_TIMEOUT_S (it finishes on its
        thread, and its result stays in the cache)."""
        grammar_source(spec, field)  # size and form first: nothing queues for a bad one
        run = asyncio.get_running_loop().run_in_executor(self._thread, self.compile, spec,
                                                         field)
        try:
            return await asyncio.wait_for(run, COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise ValueError(f"{field}: took over {COMPILE_TIMEOUT_S:.0f} s to compile") from None

    def cache_bytes(self) -> int:
        """Bytes of compiled grammars held for reuse (at most GRAMMAR_CACHE_BYTES)."""
        return self._compiler.get_cache_size_bytes() if self._compiler is not None else 0

    def matcher(self, compiled) -> GrammarState:
        """A fresh matcher at the grammar's start."""
        return GrammarState(self._xgr, compiled, self.vocab_size, self._encode)

    def _encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))


def _check_size(where: str, text: str) -> None:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{where}: larger than {MAX_GRAMMAR_BYTES} bytes")


def error_text(e: Exception) -> str:
    """An xgrammar error's message without its source location."""
    # "[04:08:06] /project/cpp/regex_converter.cc:83: Regex parsing error ..." -> the error.
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    if sep and ".cc:" in head:
        return rest.strip()
    return text


class GrammarState:
    """One sequence's position in its grammar: only emitted tokens are ever accepted
    for good; drafts are walked and rolled back."""

    def __init__(self, xgr, compiled, vocab_size: int, encode=None):
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled)  # rolls back any number of tokens
        self._encode = encode  # text -> token ids, for the grammar's forced text

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows in order (the rest are cut)."""
        n = 0
        for t in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_masks(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
        """bitmask: [N, ceil(V / 32)] int32; rows first_row .. first_row + len(drafts) get
        the allowed tokens after drafts[:j] (every draft must be allowed)."""
        m = self.matcher
        for j in range(len(drafts) + 1):
            if m.is_terminated():
                # After an end-of-sequence draft: the sequence ends there, whatever
                # this row would sample is dropped. Leave it unmasked.
                bitmask[first_row + j] = -1
            else:
                m.fill_next_token_bitmask(bitmask, first_row + j)
            if j < len(drafts) and not m.accept_token(drafts[j]):
                raise ValueError(f"draft {j} ({drafts[j]}) is not allowed by the grammar")
        if drafts:
            m.rollback(len(drafts))

    def forced_tokens(self, drafts: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` draft tokens for the text the grammar forces after `drafts`
        (allowed ones): a schema's keys, quotes, braces. The forced string is
        tokenized as the tokenizer would write it and cut where the grammar refuses a
        token; these are drafts like any other (a deterministic proposal, one-hot q),
        verified by the target, so a tokenization the target would not choose costs
        acceptance, never exactness."""
        if limit <= 0 or self._encode is None:
            return []
        m = self.matcher
        for t in drafts:
            if not m.accept_token(t):
                raise ValueError(f"draft {t} is not allowed by the grammar")
        out: list[int] = []
        text = "" if m.is_terminated() else m.find_jump_forward_string()
        if text:
            for t in self._encode(text)[:limit]:
                if not (0 <= t < self.vocab_size and m.accept_token(t)):
                    break
                out.append(t)
        if drafts or out:
            m.rollback(len(drafts) + len(out))
        return out

    def accept(self, tokens: Sequence[int]) -> None:
        """Emitted tokens, for good. A token the grammar forbids can only be one it did
        not constrain (max_tokens reached mid-way never calls this with more)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(t):
                raise ValueError(f"token {t} is not allowed by the grammar")

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V / 32)] int32, every token allowed."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [N, ceil(V / 32)] int32 (bit b of word w: token 32 w + b) -> [N, V] bool."""
    import torch  # noqa: PLC0415

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
