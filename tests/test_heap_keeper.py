"""The worker's heap keeper: with the worker's malloc tuning (freed memory kept), a freed peak stays resident
until the keeper's trim hands it back; its samples count what is in use, what is free, and what it gave back;
it trims at most once a period."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.worker.heap_keeper import HeapKeeper

pytestmark = pytest.mark.skipif(not HeapKeeper(1.0).available, reason="glibc's mallinfo2/malloc_trim only")

# In a fresh process (the tuning is process-wide): hold 64 MB, free a 256 MB peak, then trim.
_SCRIPT = """
import json, torch
from tandem.worker.malloc_tuning import keep_freed_memory
from tandem.worker.heap_keeper import HeapKeeper, _rss_bytes
assert keep_freed_memory()
keeper = HeapKeeper(30.0)
held = torch.ones(16 << 20)  # 64 MB
peak = torch.ones(64 << 20)  # 256 MB
del peak
before = _rss_bytes()
s = keeper.sample_now()
print(json.dumps({"before": before, "after": s.rss, "in_use": s.in_use, "free": s.free,
                  "released": s.released, "trims": s.trims, "held": held.numel() * 4}))
"""


def test_a_freed_peak_stays_resident_until_the_trim_gives_it_back() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mb = 1 << 20
    assert r["released"] >= 200 * mb, r  # the peak was resident after its free, and the trim returned it
    assert r["before"] - r["after"] >= 200 * mb, r
    assert r["in_use"] >= r["held"], r  # the live tensor is counted in use...
    assert r["in_use"] < r["held"] + 200 * mb, r  # ...the freed peak is not
    assert r["trims"] == 1


def test_it_trims_at_most_once_a_period_and_never_with_period_zero() -> None:
    now = [100.0]
    keeper = HeapKeeper(10.0, clock=lambda: now[0])
    assert keeper.tick() is None
    now[0] += 9.9
    assert keeper.tick() is None
    now[0] += 0.2
    first = keeper.tick()
    assert first is not None and first.trims == 1 and first.in_use > 0 and first.rss > 0
    assert keeper.tick() is None  # the period starts again from the trim
    now[0] += 10.0
    second = keeper.tick()
    assert second is not None and second.trims == 2 and second.released >= first.released
    never = HeapKeeper(0.0, clock=lambda: now[0])
    now[0] += 1e6
    assert never.tick() is None and never.trims == 0
    # An idle worker waits a period on its inbox between ticks, and blocks (0) when it never trims.
    assert keeper.idle_poll_ms == 10_000 and never.idle_poll_ms == 0 and HeapKeeper(1e-6).idle_poll_ms == 1
