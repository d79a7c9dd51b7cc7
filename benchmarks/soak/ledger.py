"""Every request the soak sends, with the outcome its kind predicts and the one it got.

A request ends exactly once: `end()` twice on one record is counted as a double end, and a record never
ended by the end of the run as a lost one. The outcome is a short string: "ok", "left" (the client left
a stream early), "cancelled", "unanswered", or "error:<code>" / "http:<status>:<code>".
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Record:
    id: int
    kind: str  # e.g. "zmq.stream_left", "http.bad.unknown_model"
    expect: tuple[str, ...]  # the outcomes its kind allows
    reaches_scheduler: bool  # counted in the engine's finished + failed once it ends
    start: float
    end_t: float | None = None
    outcome: str | None = None
    detail: str = ""
    ends: int = 0
    ttft: float | None = None  # seconds, streams only
    tpot: float | None = None  # seconds per output token after the first, streams only
    tokens: int = 0

    @property
    def as_expected(self) -> bool:
        return self.outcome in self.expect and not self.detail.startswith("BAD:")


@dataclass
class Ledger:
    records: list[Record] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count = field(default_factory=itertools.count)

    def begin(self, kind: str, expect: tuple[str, ...], reaches_scheduler: bool) -> Record:
        rec = Record(next(self._ids), kind, expect, reaches_scheduler, time.monotonic())
        with self._lock:
            self.records.append(rec)
        return rec

    def end(self, rec: Record, outcome: str, detail: str = "", tokens: int = 0, ttft: float | None = None,
            tpot: float | None = None) -> None:
        """detail starting with "BAD:" marks a wrong result (a check of the output failed)."""
        with self._lock:
            rec.ends += 1
            if rec.ends > 1:
                return  # the first end stands; the double end is what the check reports
            rec.end_t, rec.outcome, rec.detail = time.monotonic(), outcome, detail
            rec.tokens, rec.ttft, rec.tpot = tokens, ttft, tpot

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def to_json(self) -> list[dict]:
        return [asdict(r) for r in self.snapshot()]
