"""Streaming detokenization.

Decoding each token on its own is wrong in two ways: byte-level tokens can carry part of
a UTF-8 character (alone they decode to U+FFFD), and SentencePiece-style decoders strip
the leading space of the first token they see. So, as vLLM and TGI do, we decode a short
window that starts a few tokens back (``prefix_offset``) and emit only what the tokens
after ``read_offset`` added to it, holding back a trailing incomplete character.

Unlike the classic version, text that is already complete is emitted even while the
window still ends inside a character: byte-level tokens often straddle two characters
(last bytes of one, first bytes of the next), and waiting for a token that ends exactly
on a character boundary would stall such runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"

# How many prompt tokens to decode as left context of the first generated token: enough
# for the leading-space decision and for a character split across tokens.
_PROMPT_CONTEXT_TOKENS = 5

# The window can only be cut where a token ends on a character boundary. Real text has
# one every few tokens; a model emitting invalid bytes may never produce one, so past
# this many tokens the window is cut anyway (the only case where the output may differ
# from decoding everything at once), which keeps the cost of every step bounded.
_MAX_WINDOW_TOKENS = 32


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text, never emitting a partial character.

    After ``flush()``, ``text`` equals decoding all generated ids at once. With
    ``prompt_ids`` it equals what the generated ids add to the decoded prompt, which
    keeps a leading space that decoding the generated ids alone would drop.

    The exception is output that is not valid UTF-8: a byte-fallback decoder replaces
    every byte of an invalid run, including ASCII ones, whereas here the characters
    already emitted before the run turned invalid stay as they were.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Ids that decode to nothing are kept out of the window: they cannot change the
        # text, and a run of them would otherwise grow the window.
        skipped = getattr(tokenizer, "skipped_token_ids", frozenset())
        self._dropped = frozenset(skipped) if skip_special_tokens else frozenset()
        self._ids: list[int] = self._prompt_context(prompt_ids or ())
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        prefix_text = self._decode(0, self._read_offset)
        self._prefix_len = len(prefix_text)
        # Characters of decode(ids[prefix_offset:]) that are already out (or are prompt).
        self._emitted = len(prefix_text.rstrip(_REPLACEMENT))
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def add(self, new_ids: Sequence[int]) -> str:
        """Feed the ids of one decoding step (any number); returns the text completed."""
        start = len(self._ids)
        self._ids.extend(i for i in new_ids if i not in self._dropped)
        end = len(self._ids)
        if end == start:
            return ""
        text = self._decode(self._prefix_offset, end)
        if not text.endswith(_REPLACEMENT):
            out = self._advance(end, text)
        elif end - self._prefix_offset > _MAX_WINDOW_TOKENS:
            out = self._advance(end, text, force=True)
        else:
            out = self._take(text.rstrip(_REPLACEMENT))
            out += self._advance_to_last_boundary(start, end)
        return self._emit(out)

    def flush(self) -> str:
        """End of stream: emit whatever is held, incomplete characters included."""
        out = self._take(self._decode(self._prefix_offset, len(self._ids)))
        self._ids.clear()
        self._prefix_offset = self._read_offset = self._prefix_len = self._emitted = 0
        return self._emit(out)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        ids = [i for i in prompt_ids if i not in self._dropped]
        # The context must start on a character boundary: a byte-fallback decoder turns a
        # whole run of byte tokens into U+FFFD if it starts mid-character, and that run
        # could go on into the generated tokens. Starting mid-character shows as a leading
        # U+FFFD, and a character spans at most four tokens, so look that far back.
        last = max(len(ids) - _PROMPT_CONTEXT_TOKENS, 0)
        for start in range(last, max(last - 4, 0) - 1, -1):
            if not self._decode_ids(ids[start:]).startswith(_REPLACEMENT):
                return ids[start:]
        return ids[last:]

    def _take(self, complete: str) -> str:
        out = complete[self._emitted :]
        self._emitted = max(self._emitted, len(complete))
        return out

    def _advance_to_last_boundary(self, start: int, end: int) -> str:
        # Earlier positions were tried when they ended a step, so only this step's are new.
        for b in range(end - 1, max(start, self._read_offset), -1):
            text = self._decode(self._prefix_offset, b)
            if not text.endswith(_REPLACEMENT):
                return self._advance(b, text)
        return ""

    def _advance(self, boundary: int, text: str, force: bool = False) -> str:
        """Emit ``text`` = decode(ids[prefix_offset:boundary]) and, where it ends on a
        whole character, make ``boundary`` the read offset."""
        # Byte-fallback decoders turn a whole run of byte tokens into U+FFFD while its
        # last character is open, so the stripped full text can be shorter than this.
        out = self._take(text)
        boundary_len = len(text)
        # Until the tokens since read_offset show text, the next window could start with
        # nothing for a SentencePiece decoder to strip a leading space from; wait.
        if boundary_len <= self._prefix_len and not force:
            return out
        new_prefix_len = len(self._decode(self._read_offset, boundary))
        # Text past the boundary reads the same in the old and the new window, so the
        # count of emitted characters carries over, re-based on the new window's start.
        self._emitted = new_prefix_len + (self._emitted - boundary_len)
        self._prefix_offset, self._read_offset = self._read_offset, boundary
        self._prefix_len = new_prefix_len
        # Ids before prefix_offset are never decoded again.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return out

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end]) if start < end else ""

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, out: str) -> str:
        if out:
            self._text_parts.append(out)
        return out
