"""Stop-string matching over a streamed text, one per request.

Stop strings are matched on text, not tokens, so a match can span any number of deltas. The
matcher holds back the longest tail of the pending text that could still grow into a stop string
and emits the rest at once, so the held text is always shorter than the longest stop string.

When several stop strings could match, the one that *completes* first in the text wins (ties:
the longest, i.e. the one starting earliest). That is the match a one-char-at-a-time stream sees,
so the result does not depend on how the text is chunked into deltas.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        # An empty stop string would match before any output; treat it as absent.
        self.stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self.include_in_output = include_in_output
        self._prefixes = {s[:i] for s in self.stops for i in range(1, len(s))}
        self._max_prefix = max((len(s) - 1 for s in self.stops), default=0)
        self._pending = ""
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Return (text safe to emit now, the stop string if it matched in this call).

        After a match every later call returns ("", None); `matched` keeps the stop string.
        """
        if self.matched is not None:
            return "", None
        buf = self._pending + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop); longest first on ties
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is not None:
            end, start, stop = best
            self.matched = stop
            self._pending = ""
            return buf[: end if self.include_in_output else start], stop
        hold = self._held_tail(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def _held_tail(self, buf: str) -> int:
        # Length of the longest suffix of `buf` that is a proper prefix of some stop string.
        for k in range(min(len(buf), self._max_prefix), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0

    def flush(self) -> str:
        """At a finish without a match: release the held-back tail."""
        if self.matched is not None:
            return ""
        out, self._pending = self._pending, ""
        return out
