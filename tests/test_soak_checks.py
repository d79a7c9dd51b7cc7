"""The soak's verdicts on synthetic data: lost, doubled and unexpected requests, a miscount by the engine,
RSS that climbs after warm-up (and noise that does not), a growing fd count, TPOT that degrades."""
from __future__ import annotations

import random
from types import SimpleNamespace

from tandem.benchmarks.soak.checks import engine_checks, growth_checks, ledger_checks, tpot_check
from tandem.benchmarks.soak.ledger import Ledger


def _verdicts(checks) -> dict[str, bool]:
    return {c.name: c.ok for c in checks}


def test_the_ledger_finds_lost_doubled_and_unexpected_requests_and_a_miscount() -> None:
    led = Ledger()
    ok = led.begin("zmq.generate", ("ok",), True)
    led.end(ok, "ok")
    assert all(_verdicts(ledger_checks(led.snapshot(), engine_ended=1)).values())
    assert not _verdicts(ledger_checks(led.snapshot(), engine_ended=2))[
        "the engine ended each request it was given exactly once"]

    lost = led.begin("zmq.stream", ("ok",), True)
    twice = led.begin("zmq.bad.temperature", ("error:invalid_request.params",), False)
    led.end(twice, "error:invalid_request.params")
    led.end(twice, "ok")
    wrong = led.begin("http.completion", ("ok",), True)
    led.end(wrong, "ok", "BAD: finish None")  # the right outcome, but a check of its output failed
    v = _verdicts(ledger_checks(led.snapshot(), engine_ended=3))
    assert v == {"every request ended": False, "no request ended twice": False,
                 "every outcome is the one its kind predicts": False,
                 "the engine ended each request it was given exactly once": True}
    assert twice.outcome == "error:invalid_request.params" and lost.ends == 0


def _samples(rss, fds, t_step: float = 10.0) -> list[dict]:
    return [{"t": i * t_step, "procs": {"tandem-worker0": {"rss_mb": r, "fds": f}}, "engine": {}}
            for i, (r, f) in enumerate(zip(rss, fds))]


def test_growth_after_warmup_fails_and_noise_or_warmup_growth_does_not() -> None:
    rng = random.Random(0)
    n = 60
    flat = [500 + rng.uniform(-15, 15) for _ in range(n)]  # noisy, no trend
    warming = [300 + min(i, 20) * 10 + rng.uniform(-5, 5) for i in range(n)]  # rises, then flat by 200 s
    leaking = [500 + i * 1.0 for i in range(n)]  # 1 MB per 10 s: 40 MB over the measured 400 s
    fds = [40 + rng.choice((0, 1, -1)) for _ in range(n)]
    assert _verdicts(growth_checks(_samples(flat, fds), warmup_s=180))["no RSS or fd growth after warm-up"]
    assert _verdicts(growth_checks(_samples(warming, fds), warmup_s=200))["no RSS or fd growth after warm-up"]
    assert not _verdicts(growth_checks(_samples(leaking, fds), warmup_s=180))[
        "no RSS or fd growth after warm-up"
    ]
    fd_leak = [40 + i // 4 for i in range(n)]
    assert not _verdicts(growth_checks(_samples(flat, fd_leak), warmup_s=180))[
        "no RSS or fd growth after warm-up"
    ]
    assert not _verdicts(growth_checks(_samples(flat[:3], fds[:3]), warmup_s=0))[
        "no RSS or fd growth after warm-up"
    ]


def test_a_growing_worker_heap_fails_even_while_rss_is_flat() -> None:
    rng = random.Random(1)
    n = 60
    flat = [1400 + rng.uniform(-10, 10) for _ in range(n)]
    fds = [40] * n

    def with_heap(in_use_mb: list[float]) -> list[dict]:
        samples = _samples(flat, fds)
        for s, mb in zip(samples, in_use_mb):
            s["engine"] = {
                "worker_heap": {
                    "in_use": int(mb * 2**20),
                    "free": 50 << 20,
                    "rss": int(1400 * 2**20),
                    "trims": 1,
                    "released": 0,
                }
            }
        return samples

    steady = with_heap([300 + rng.uniform(-5, 5) for _ in range(n)])
    leak = with_heap([300 + i * 1.0 for i in range(n)])  # 40 MB over the measured 400 s
    assert _verdicts(growth_checks(steady, warmup_s=180))["worker heap in use flat after warm-up"]
    v = _verdicts(growth_checks(leak, warmup_s=180))
    assert v["no RSS or fd growth after warm-up"] and not v["worker heap in use flat after warm-up"]
    assert "worker heap in use flat after warm-up" not in _verdicts(
        growth_checks(_samples(flat, fds), warmup_s=180)
    )


def test_engine_state_checks() -> None:
    st = SimpleNamespace(kv_free=100, kv_cached=28, kv_pool_size=128, kv_cache_locked=0, running=0, waiting=0,
                         frontend_pending=0, integrity="ok")
    assert all(_verdicts(engine_checks(st)).values())
    st.kv_free = 99  # one slot leaked
    st.integrity = "slot 7 is both free and held"
    v = _verdicts(engine_checks(st))
    assert not v["KV free back to the whole pool"] and not v["prefix-cache integrity"]


def test_p99_tpot_compares_the_first_and_last_tenth() -> None:
    led = Ledger()
    for i in range(100):
        r = led.begin("zmq.stream", ("ok",), True)
        r.start = float(i)
        led.end(r, "ok", tpot=0.010 if i < 90 else 0.030)
    assert not tpot_check(led.snapshot(), 0.0, 100.0, max_ratio=2.0).ok
    assert tpot_check(led.snapshot(), 0.0, 100.0, max_ratio=3.5).ok
