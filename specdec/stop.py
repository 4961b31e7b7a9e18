"""Text-level stop strings for streamed output.

A stop string can straddle any number of token (and detokenizer) boundaries, so the
tail of the stream that could still turn into one is held back until it either
completes the stop string (the text is cut there) or stops looking like one (released).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    def __init__(self, stop: Iterable[str]) -> None:
        # An empty stop string would match before any output; clients that send one mean
        # "no stop string", so it is ignored rather than rejected.
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
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
        hit = self._earliest_match(buf)
        if hit is not None:
            pos, self._matched = hit
            self._held = ""
            return buf[:pos]
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of stream without a match: the held tail was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self._matched is not None else out

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self._stops:
            pos = buf.find(s)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _partial_suffix_len(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop string. Holding the
        # longest one is what guarantees no match is missed: any stop string starting in
        # released text would have made a longer suffix qualify.
        longest = min(len(buf), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
