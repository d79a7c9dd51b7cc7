"""The many-model server's policy (frontend/router/model_pool.py), driven with fake engines and a fake clock:
loads on demand and once, keep-alive, LRU eviction that spares busy and pinned models, failed loads and dead
engines."""
from __future__ import annotations

import asyncio

import pytest

from tandem.frontend.router.model_pool import LoadFailed, ModelPool, NoRoom, UnknownModel
from tandem.protocol.model_spec import FOREVER, ModelSpec, parse_keep_alive, read_models_file


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.url, self.running, self.stopped = f"http://{name}", True, False

    def alive(self) -> bool:
        return self.running and not self.stopped

    async def stop(self) -> None:
        await asyncio.sleep(0)
        self.stopped = True


class Starter:
    def __init__(self, delay: float = 0.01) -> None:
        self.starts: list[str] = []
        self.engines: list[FakeEngine] = []
        self.fail: set[str] = set()
        self.delay = delay

    async def __call__(self, spec: ModelSpec) -> FakeEngine:
        self.starts.append(spec.name)
        await asyncio.sleep(self.delay)
        if spec.name in self.fail:
            raise RuntimeError(f"{spec.name}: no such file")
        e = FakeEngine(spec.name)
        self.engines.append(e)
        return e


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _pool(names: str, max_loaded: int = 2, keep: float = 300.0, pinned: str = "", **kw: object):
    starter, clock = Starter(), Clock()
    specs = [ModelSpec(n, f"/m/{n}", pinned=n in pinned) for n in names.split()]
    return ModelPool(specs, max_loaded, keep, starter, clock=clock, **kw), starter, clock


def test_concurrent_first_requests_start_the_model_once() -> None:
    async def go() -> None:
        pool, starter, _ = _pool("a b")
        engines = await asyncio.gather(*(pool.acquire("a") for _ in range(8)))
        assert starter.starts == ["a"] and len({id(e) for e in engines}) == 1
        assert pool.entries["a"].running == 8
        pool.check_integrity()
        for _ in range(8):
            pool.release("a")
        assert pool.entries["a"].running == 0 and pool.entries["a"].state == "loaded"
        pool.check_integrity()

    asyncio.run(go())


def test_keep_alive_unloads_after_idle_and_a_request_keeps_it() -> None:
    async def go() -> None:
        pool, starter, clock = _pool("a", keep=300)
        await pool.acquire("a")
        clock.t += 1000  # busy: never expires while a request runs
        assert await pool.reap() == [] and pool.entries["a"].state == "loaded"
        pool.release("a")
        clock.t += 299
        assert await pool.reap() == []
        clock.t += 2
        assert await pool.reap() == ["a"]
        assert pool.entries["a"].state == "unloaded" and starter.engines[0].stopped
        await pool.acquire("a")  # loads again
        assert starter.starts == ["a", "a"]
        pool.release("a")
        pool.check_integrity()

    asyncio.run(go())


def test_a_requests_keep_alive_overrides_zero_unloads_at_once_and_forever_never() -> None:
    async def go() -> None:
        pool, starter, clock = _pool("a b", keep=300)
        await pool.acquire("a", keep_alive_s=0)
        pool.release("a")
        await asyncio.sleep(0.01)
        assert pool.entries["a"].state == "unloaded" and starter.engines[0].stopped
        await pool.acquire("b", keep_alive_s=FOREVER)
        pool.release("b")
        clock.t += 10**9
        assert await pool.reap() == [] and pool.entries["b"].expires_at is None
        await pool.acquire("b", keep_alive_s=60)  # the latest request's keep_alive holds (ollama's rule)
        pool.release("b")
        assert pool.entries["b"].expires_at == clock.t + 60
        pool.check_integrity()

    asyncio.run(go())


def test_loading_past_the_limit_evicts_the_least_recently_used_idle_model() -> None:
    async def go() -> None:
        pool, starter, clock = _pool("a b c", max_loaded=2)
        for n in "ab":
            await pool.acquire(n)
            clock.t += 1
        pool.release("b")
        clock.t += 1
        pool.release("a")  # a used last: b is the least recently used
        await pool.acquire("c")
        assert [e.spec.name for e in pool.loaded()] == ["a", "c"]
        assert starter.engines[1].stopped and not starter.engines[0].stopped
        pool.check_integrity()

    asyncio.run(go())


def test_busy_and_pinned_models_are_never_evicted_and_a_load_waits_then_gives_up() -> None:
    async def go() -> None:
        pool, starter, clock = _pool("p a c", max_loaded=2, pinned="p", room_wait_s=0.3)
        await pool.load_pinned()
        assert starter.starts == ["p"] and pool.entries["p"].state == "loaded"
        await pool.acquire("a")  # busy
        waiting = asyncio.ensure_future(pool.acquire("c"))
        await asyncio.sleep(0.05)
        assert not waiting.done() and pool.entries["c"].state == "loading"
        pool.release("a")  # room: a (idle, unpinned) goes, c comes
        await asyncio.wait_for(waiting, 2)
        assert {e.spec.name for e in pool.loaded()} == {"p", "c"}
        pool.check_integrity()
        # now c busy, p pinned: nothing can go, and after room_wait_s the load is refused
        real_clock = _Real()
        pool._clock = real_clock
        with pytest.raises(NoRoom, match="busy"):
            await pool.acquire("a")
        assert pool.entries["a"].state == "failed" and pool.entries["p"].state == "loaded"
        clock.t += 10**9
        pool._clock = clock
        assert await pool.reap() == []  # p pinned, c busy
        pool.release("c")
        pool.check_integrity()

    asyncio.run(go())


class _Real:
    def __call__(self) -> float:
        return asyncio.get_event_loop().time()


def test_a_load_waiting_for_room_is_not_starved_by_new_requests_for_the_busy_model() -> None:
    async def go() -> None:
        pool, starter, _ = _pool("a b", max_loaded=1)
        await pool.acquire("a")
        b = asyncio.ensure_future(pool.acquire("b"))
        await asyncio.sleep(0.05)
        assert pool.entries["a"].draining and not b.done()
        late_a = asyncio.ensure_future(pool.acquire("a"))  # would keep a busy forever if it joined
        await asyncio.sleep(0.05)
        assert not late_a.done() and pool.entries["a"].running == 1
        pool.release("a")  # a's last request ends: a goes, b comes
        await asyncio.wait_for(b, 2)
        assert [e.spec.name for e in pool.loaded()] == ["b"] and not late_a.done()
        pool.check_integrity()
        pool.release("b")  # and then a again, for the request that waited
        await asyncio.wait_for(late_a, 2)
        assert [e.spec.name for e in pool.loaded()] == ["a"] and starter.starts == ["a", "b", "a"]
        pool.release("a")
        pool.check_integrity()

    asyncio.run(go())


def test_two_loads_waiting_for_one_place_take_it_in_turn() -> None:
    async def go() -> None:
        pool, starter, _ = _pool("a b c", max_loaded=1)
        await pool.acquire("a")
        b, c = asyncio.ensure_future(pool.acquire("b")), asyncio.ensure_future(pool.acquire("c"))
        await asyncio.sleep(0.05)
        pool.release("a")
        done, _ = await asyncio.wait([b, c], timeout=2, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(pool.loaded()) == 1
        pool.check_integrity()
        first = pool.loaded()[0].spec.name
        pool.release(first)
        await asyncio.wait_for(asyncio.gather(b, c), 2)
        second = pool.loaded()[0].spec.name
        assert {first, second} == {"b", "c"} and starter.starts == ["a", first, second]
        pool.release(second)
        pool.check_integrity()

    asyncio.run(go())


def test_a_failed_load_fails_every_waiter_and_the_next_request_tries_again() -> None:
    async def go() -> None:
        pool, starter, _ = _pool("a b")
        starter.fail.add("a")
        got = await asyncio.gather(*(pool.acquire("a") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(g, LoadFailed) and "no such file" in str(g) for g in got)
        assert starter.starts == ["a"] and pool.entries["a"].state == "failed"
        await pool.acquire("b")  # the others keep serving
        pool.release("b")
        starter.fail.clear()
        await pool.acquire("a")
        assert pool.entries["a"].state == "loaded" and pool.entries["a"].error is None
        pool.release("a")
        pool.check_integrity()
        with pytest.raises(UnknownModel):
            await pool.acquire("nope")

    asyncio.run(go())


def test_a_dead_engine_is_started_again_and_a_caller_who_leaves_does_not_cancel_the_load() -> None:
    async def go() -> None:
        pool, starter, _ = _pool("a", max_loaded=1)
        starter.delay = 0.1
        leaver = asyncio.ensure_future(pool.acquire("a"))
        await asyncio.sleep(0.02)
        leaver.cancel()
        stayer = await pool.acquire("a")
        assert starter.starts == ["a"] and stayer.alive()
        pool.release("a")
        starter.engines[0].running = False  # the process died
        assert await pool.reap() == ["a"] and pool.entries["a"].state == "unloaded"
        await pool.acquire("a")
        assert starter.starts == ["a", "a"]
        assert starter.engines[0].stopped  # the dead one's process reaped and its owner socket closed
        pool.release("a")
        pool.check_integrity()

    asyncio.run(go())


def test_unload_now_spares_a_busy_model() -> None:
    async def go() -> None:
        pool, starter, _ = _pool("a")
        await pool.acquire("a")
        assert not await pool.unload("a")
        pool.release("a")
        assert await pool.unload("a") and starter.engines[0].stopped
        assert await pool.unload("a")  # not loaded: nothing to do
        pool.check_integrity()

    asyncio.run(go())


def test_a_memory_budget_unloads_idle_models_until_the_next_fits() -> None:
    async def go() -> None:
        sizes = {"a": 40, "b": 50, "c": 70, "huge": 200}

        async def prepare(spec: ModelSpec) -> int:
            return sizes[spec.name]

        pool, starter, clock = _pool("a b c huge", max_loaded=3, prepare=prepare, memory_budget=100,
                                     room_wait_s=0.2)
        for n in "ab":  # 90 of 100
            await pool.acquire(n)
            pool.release(n)
            clock.t += 1
        await pool.acquire("c")  # 70: both a and b must go (3 models would be allowed by count)
        assert [e.spec.name for e in pool.loaded()] == ["c"]
        assert starter.engines[0].stopped and starter.engines[1].stopped
        pool.check_integrity()
        pool._clock = _Real()
        with pytest.raises(NoRoom, match="busy \\(c\\)"):  # c runs a request: a (40) cannot join it
            await pool.acquire("a")
        pool.release("c")
        await pool.acquire("a")  # c idle now: it goes
        assert [e.spec.name for e in pool.loaded()] == ["a"]
        with pytest.raises(NoRoom, match="more than the memory budget"):
            await pool.acquire("huge")
        assert "huge" not in starter.starts and pool.entries["a"].state == "loaded"  # nothing went for it
        pool.release("a")
        pool.check_integrity()

    asyncio.run(go())


@pytest.mark.parametrize("given,secs", [
    ("5m", 300), ("30s", 30), ("1h", 3600), ("1h30m", 5400), ("1.5s", 1.5), ("0", 0), (0, 0), ("0s", 0),
    (90, 90), ("90", 90), (-1, FOREVER), ("-1", FOREVER), ("-1m", FOREVER), ("250ms", 0.25), (2.5, 2.5),
])
def test_keep_alive_takes_ollamas_forms(given: object, secs: float) -> None:
    assert parse_keep_alive(given) == pytest.approx(secs)


@pytest.mark.parametrize("bad", ["", "5 minutes", "m", "5x", "1h-2m", True, None, [], "--1"])
def test_keep_alive_refuses_anything_else(bad: object) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(bad)


def test_models_file(tmp_path) -> None:
    f = tmp_path / "models.toml"
    f.write_text('[[model]]\nname = "chat"\nmodel = "smollm2-135m-instruct"\nkeep_alive = "10m"\npinned = true\n'
                 '[model.options]\ndtype = "float32"\n\n[[model]]\nmodel = "/x/y/model.gguf"\n')
    a, b = read_models_file(f)
    assert (a.name, a.model, a.keep_alive_s, a.pinned, a.options) == (
        "chat", "smollm2-135m-instruct", 600, True, {"dtype": "float32"})
    assert (b.name, b.keep_alive_s, b.pinned) == ("y", None, False)  # a pulled layout's folder
    for text, why in [
        ('[[model]]\nmodel = "a"\nsize = 3\n', "unknown key.*size"),
        ('[[model]]\nname = "a"\n', "`model`.*required"),
        ('[[model]]\nmodel = "a"\n[model.options]\nwarp = 9\n', "unknown engine option.*warp"),
        ('[[model]]\nmodel = "a"\n[model.options]\ndtype = "float8"\n', "dtype"),
        ('[[model]]\nmodel = "a"\nkeep_alive = "soon"\n', "keep_alive"),
        ('[[model]]\nmodel = "a"\n[[model]]\nmodel = "a"\n', "given twice: a"),
        ('title = "x"\n', "\\[\\[model\\]\\]"),
        ("[[model\n", "models file"),
    ]:
        f.write_text(text)
        with pytest.raises(ValueError, match=why):
            read_models_file(f)
