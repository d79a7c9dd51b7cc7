"""Holding back streamed text that may turn out to be a stop string.

The scheduler decides every stop and says how many characters to cut from the end of the text; the
detokenizer only has to make sure it has not streamed them yet. So it holds back the longest tail of
the text that is a proper prefix of some stop string (a stop string completed by the newest token
lies in that tail plus the newest token's text), and releases it as the text moves on.
"""

from __future__ import annotations


class StopHoldBack:
    def __init__(self, stops: list[str]) -> None:
        self._prefixes = {s[:i] for s in stops for i in range(1, len(s))}
        self._max_prefix = max((len(s) - 1 for s in stops), default=0)
        self._pending = ""

    def feed(self, delta: str) -> str:
        """The text safe to stream now."""
        buf = self._pending + delta
        hold = self._held_tail(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def _held_tail(self, buf: str) -> int:
        # Length of the longest suffix of `buf` that is a proper prefix of some stop string.
        for k in range(min(len(buf), self._max_prefix), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0

    def finish(self, delta: str, cut: int) -> str:
        """The rest of the text at the finish, less the `cut` characters the scheduler's stop drops."""
        buf, self._pending = self._pending + delta, ""
        return buf[: max(0, len(buf) - cut)]
