"""Structured output on the scheduler's side: grammars compile off the queue, one matcher per request,
and the bitmask of a deferred step is filled from the matchers once every earlier step is committed
(forward early, sample late: docs/architecture.md §5)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from protocol.messages import SampleStep
from protocol.sampling_params import SamplingParams
from scheduler.req import Req
from scheduler.step_plan import InflightStep


class StructuredOutput:
    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._service: Any = None
        self.compiling: dict[str, tuple[Req, Future]] = {}

    @staticmethod
    def wants_grammar(p: SamplingParams) -> bool:
        return (p.json_schema is not None or p.json_object or p.regex is not None or p.grammar is not None
                or p.choice is not None)

    def _compiler(self) -> Any:
        if self._service is None:  # xgrammar and the tokenizer load on first use only
            from scheduler.grammar import GrammarCompilerService

            # Compact JSON: a weak model could otherwise loop on whitespace forever.
            self._service = GrammarCompilerService(self.model_dir, self.vocab_size, any_whitespace=False)
        return self._service

    def submit(self, req: Req) -> None:
        from scheduler.grammar import GrammarSpec

        try:
            fut = self._compiler().submit(GrammarSpec.from_params(req.params))
        except Exception as e:  # noqa: BLE001 - reported through poll(), like a failed compilation
            fut = Future()
            fut.set_exception(e)
        self.compiling[req.rid] = (req, fut)

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        for rid, (req, fut) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            try:
                req.grammar = self._service.matcher(fut.result())
                ready.append(req)
            except Exception as e:  # noqa: BLE001 - any compile failure ends that request, not the engine
                failed.append((req, str(e)))
        return ready, failed

    def sample_step(self, step: InflightStep) -> tuple[SampleStep, list[tuple[Req, str]]]:
        """The step's bitmask, and the requests whose matcher raised (their rows are left unmasked)."""
        from scheduler.grammar import allocate_bitmask

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
            except Exception as e:  # noqa: BLE001 - a matcher error fails its request, not the engine
                mask[k] = -1
                failed.append((req, f"grammar matcher: {type(e).__name__}: {e}"))
        return SampleStep(step.step_id, rows, mask.numpy().tobytes()), failed
