"""What a user sees first: `make demo` shows each answer as it arrives (with its rate), and the cold-start
benchmark (benchmarks/structured_start.py) reports every figure. No timing assertions."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tandem.launch.demo import _show, _Stream


def test_demo_prints_a_stream_as_it_arrives(capsys: pytest.CaptureFixture[str]) -> None:
    s = _Stream()
    seen: list[str] = []

    async def produce() -> None:
        for piece in ["\n", "Paris", " is", " the capital."]:
            await asyncio.sleep(0.01)
            s.first = s.first or s.start + 0.1
            s.text += piece
            s.tokens += 1
            s.changed.set()
            await asyncio.sleep(0.01)
            seen.append(capsys.readouterr().out)  # what the terminal showed after each piece
        s.end = s.start + 0.5
        s.changed.set()

    async def main() -> None:
        await asyncio.gather(produce(), _show(2, s, [{"role": "user", "content": "Capital?"}], {}))

    asyncio.run(main())
    rest = capsys.readouterr().out
    assert seen[0] == "> Capital?\n"  # the model's leading newline is not printed
    assert seen[1:] == ["Paris", " is", " the capital."]  # each piece when it came
    assert "[stream 2: 4 tokens in 0.50s, first after 0.10s: 8.0 tokens/s]" in rest


def test_demo_shows_a_failed_stream_in_its_place(capsys: pytest.CaptureFixture[str]) -> None:
    s = _Stream()
    s.error = RuntimeError("engine gone")
    asyncio.run(_show(0, s, [{"role": "user", "content": "Hi"}], {"json_schema": {}}))
    assert "[stream 0: failed: engine gone]" in capsys.readouterr().out


@pytest.mark.slow  # a whole benchmark run: the fast tier's minutes go to the engine's own tests
def test_structured_start_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    from tandem.benchmarks.structured_start import main

    out = tmp_path / "start.json"
    assert main(["--model", str(tiny_model("llama")), "--runs", "1", "--cold-cache", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    for k in (
        "ready_s",
        "first_s",
        "warm_s",
        "free_s",
        "new_schema_s",
        "first_over_warm",
        "first_over_new_schema",
    ):
        assert row[k] > 0, k
    assert (
        0 <= row["first_queue_s"] <= row["first_s"] and 0 <= row["new_schema_queue_s"] <= row["new_schema_s"]
    )
