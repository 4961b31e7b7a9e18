"""Text-level stop strings for streamed output.

A stop string can straddle any number of token (and detokenizer) boundaries, so the
tail of the stream that could still turn into one is held back until it either
completes the stop string (the text is cut there) or stops looking like one (released).
"""

from __future__ import annotations

from collections.abc import Iterable


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper prefix of s[:i+1]
    that is also its suffix."""
    f = [0] * len(s)
    q = 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = f[q - 1]
        if s[i] == s[q]:
            q += 1
        f[i] = q
    return f


class StopStringMatcher:
    """Stop strings found as the text streams in: one KMP automaton per stop string,
    so each character costs O(number of stop strings) however long they are and
    however much is held (the gateway scans every stream on its event loop).

    The stream ends at the first character that completes a stop string (the
    longest one where several end there); the result does not depend on how the
    text is split into chunks.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        # An empty stop string would match before any output; clients that send one mean
        # "no stop string", so it is ignored rather than rejected.
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._failures = tuple(_failure(s) for s in self._stops)
        # Per stop string: the length of the longest suffix of the text so far that
        # is a prefix of it.
        self._states = [0] * len(self._stops)
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None while none has."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not yet released because it may start a stop string."""
        return self._held

    def feed(self, text: str) -> str:
        """Add streamed text; returns the part that is safe to send on.

        Once a stop string is found, returns the text before it and then only "".
        """
        if self._matched is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        base = len(self._held)
        states = self._states
        for i, c in enumerate(text):
            hit: tuple[int, str] | None = None
            for j, s in enumerate(self._stops):
                q = states[j]
                while q and s[q] != c:
                    q = self._failures[j][q - 1]
                if s[q] == c:
                    q += 1
                if q == len(s):
                    start = base + i + 1 - q
                    if hit is None or start < hit[0]:
                        hit = (start, s)
                states[j] = q
            if hit is not None:
                self._matched = hit[1]
                self._held = ""
                return buf[:hit[0]]
        # Hold the longest suffix that is a proper prefix of some stop string: any
        # stop string starting in released text would have made a longer one qualify.
        keep = max(states)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """End of stream without a match: the held tail was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self._matched is not None else out
