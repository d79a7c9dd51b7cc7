"""Structured output on the scheduler's side: grammars compile off the queue on a small thread pool,
one matcher per request, and the bitmask of a deferred step is filled from the matchers once every
earlier step is committed (forward early, sample late: docs/architecture.md §5).

The compiler itself (xgrammar with torch and transformers, the tokenizer's vocabulary tables) takes seconds to
load: `start_compiler` builds it in a background thread while the engine starts, so the engine is ready before
it is and nothing but a constrained request that arrives first waits for it (in its compilation, off the
scheduler thread, which never imports those libraries itself).

A compilation has a deadline (grammar_compile_timeout_s, from submission): past it the request fails,
typed. A request that ends while its grammar is compiling (an abort) cancels the compilation when no
other request waits for it and it has not started; one already running cannot be interrupted (xgrammar
has no cancel) and finishes in the background, its result cached for the next request with that spec.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

from tandem.protocol.errors import ErrorCode
from tandem.protocol.messages import SampleStep
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.req import Req
from tandem.scheduler.step_plan import InflightStep

# The compiler's warm-up yields the CPU to the other processes' start and to the first requests' steps: it
# only saves a structured request's wait, and on few cores it would otherwise delay everything else.
WARM_UP_NICE = 10
COMPILE_THREADS = 2  # distinct grammars compile in parallel; a slow one does not hold up the rest


def start_compiler(model_dir: str, vocab_size: int) -> Future:
    """Build the grammar compiler service in a background thread (its result: the service, loaded)."""
    fut: Future = Future()

    def build() -> None:
        if sys.platform == "linux":  # this thread alone (a tid): the engine's start and first steps go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_UP_NICE)
        try:
            from tandem.scheduler.grammar import GrammarCompilerService

            # Compact JSON: a weak model could otherwise loop on whitespace forever.
            svc = GrammarCompilerService(
                model_dir, vocab_size, max_workers=COMPILE_THREADS, any_whitespace=False
            )
            svc.compiler  # noqa: B018 - loads it (the tokenizer's tables from disk when cached)
        except BaseException as e:  # a compilation reports it (GRAMMAR_COMPILER), like a failed one
            fut.set_exception(e)
        else:
            fut.set_result(svc)

    threading.Thread(target=build, name="grammar-compiler-start", daemon=True).start()
    return fut


def _chain(src: Future, dst: Future) -> None:
    """dst ends as src did."""
    if src.cancelled():
        dst.set_exception(CancelledError())
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


class StructuredOutput:
    def __init__(
        self, model_dir: str, vocab_size: int, timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.clock = clock
        self._service: Any = None
        self._starting: Future | None = None  # the service being built in the background (start_compiler)
        self.compiling: dict[str, tuple[Req, Future, float]] = {}  # rid -> (req, compilation, deadline)

    @staticmethod
    def wants_grammar(p: SamplingParams) -> bool:
        return (p.json_schema is not None or p.json_object or p.regex is not None or p.grammar is not None
                or p.choice is not None)

    def adopt(self, starting: Future) -> None:
        """Use the service start_compiler is building (the scheduler process starts it before the worker is
        up)."""
        self._starting = starting

    def compiler(self) -> Any:
        """The service; blocks while it is being built in the background, else builds it here on first use."""
        if self._service is None and self._starting is not None:
            try:
                self._service = self._starting.result()
            except Exception:
                pass  # built here instead: its compilations report why it fails
            self._starting = None
        if self._service is None:
            from tandem.scheduler.grammar import GrammarCompilerService

            self._service = GrammarCompilerService(
                self.model_dir, self.vocab_size, max_workers=COMPILE_THREADS, any_whitespace=False
            )
        return self._service

    @property
    def cached_bytes(self) -> int:
        """Compiled grammars held by the cache (0 before the first structured request)."""
        return self._service.cached_bytes if self._service is not None else 0

    def submit(self, req: Req) -> None:
        from tandem.scheduler.grammar_spec import GrammarSpec

        try:
            fut = self._submit_spec(GrammarSpec.from_params(req.params))
        except Exception as e:  # reported through poll(), like a failed compilation
            fut = Future()
            fut.set_exception(e)
        self.compiling[req.rid] = (req, fut, self.clock() + self.timeout_s)

    def _submit_spec(self, spec: Any) -> Future:
        starting = self._starting
        if starting is None or starting.done():
            return self.compiler().submit(spec)
        # Still loading: the compilation is submitted when it is ready, from the loading thread. Until then
        # the request's future is only ours, so an abort can still cancel it.
        out: Future = Future()

        def when_ready(f: Future) -> None:
            if not out.set_running_or_notify_cancel():
                return  # aborted meanwhile: nothing to compile
            try:
                f.result().submit(spec).add_done_callback(lambda done: _chain(done, out))
            except BaseException as e:
                out.set_exception(e)

        starting.add_done_callback(when_ready)
        return out

    def cancel(self, rid: str) -> None:
        """The request ended: stop waiting for its grammar, and drop a compilation nobody else awaits."""
        entry = self.compiling.pop(rid, None)
        if entry is not None and not any(f is entry[1] for _, f, _ in self.compiling.values()):
            entry[1].cancel()  # only a compilation not yet started can be cancelled

    def poll(self) -> tuple[list[Req], list[tuple[Req, ErrorCode, str]]]:
        """Requests whose grammar is ready, and those that failed: (req, error code, message)."""
        from tandem.scheduler.grammar_spec import GrammarBusy, GrammarError

        ready: list[Req] = []
        failed: list[tuple[Req, ErrorCode, str]] = []
        now = self.clock()
        for rid, (req, fut, deadline) in list(self.compiling.items()):
            if not fut.done():
                if now > deadline:
                    self.cancel(rid)
                    failed.append((req, ErrorCode.GRAMMAR_TIMEOUT,
                                   f"grammar did not compile within {self.timeout_s:g} s"))
                continue
            del self.compiling[rid]
            try:
                compiled = fut.result()
                req.grammar = self.compiler().matcher(compiled)  # loaded: a compilation finished
                ready.append(req)
            except GrammarError as e:  # the constraint itself is bad: the client's error
                failed.append((req, ErrorCode.INVALID_GRAMMAR, str(e)))
            except GrammarBusy as e:  # too many distinct grammars compiling (MAX_PENDING): retry later
                failed.append((req, ErrorCode.OVERLOADED, str(e)))
            except Exception as e:  # ours (e.g. the tokenizer did not load), not the client's
                failed.append(
                    (req, ErrorCode.GRAMMAR_COMPILER, f"grammar compiler failed: {type(e).__name__}: {e}")
                )
        return ready, failed

    def sample_step(self, step: InflightStep) -> tuple[SampleStep, list[tuple[Req, str]]]:
        """The step's bitmask, and the requests whose matcher raised (their rows are left unmasked)."""
        from tandem.scheduler.grammar import allocate_bitmask

        rows = [j for j, i in enumerate(step.samplers)
                if step.reqs[i].grammar is not None and not step.reqs[i].finished()
                and step.reqs[i].to_finish is None and step.epochs[i] == step.reqs[i].epoch]
        if not rows:
            return SampleStep(step.step_id, [], b""), []
        mask = allocate_bitmask(len(rows), self.vocab_size)
        failed: list[tuple[Req, str]] = []
        for k, j in enumerate(rows):
            req = step.reqs[step.samplers[j]]
            try:
                req.grammar.fill_bitmask(mask, k)
            except Exception as e:  # a matcher error fails its request, not the engine
                mask[k] = -1
                failed.append((req, f"grammar matcher: {type(e).__name__}: {e}"))
        return SampleStep(step.step_id, rows, mask.numpy().tobytes()), failed
