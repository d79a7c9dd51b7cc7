"""The house rules the layout keeps, checked on the source (docs/architecture.md, "Rules the code keeps").

Every import is read with `ast`, lazy ones inside functions included, so an arrow cannot hide in a
function body."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ("frontend", "scheduler", "worker", "detokenizer", "protocol", "kernels", "launch")
# Which top-level folders each may import. launch/ starts every process, so it alone knows them all;
# nothing imports launch/. The worker is the one process that runs kernels.
ALLOWED = {
    "protocol": set(),
    "kernels": {"protocol"},
    "frontend": {"protocol"},
    "scheduler": {"protocol"},
    "detokenizer": {"protocol"},
    "worker": {"protocol", "kernels"},
    "launch": set(ENGINE) - {"launch"},
}
MAX_FILE_LINES = 400
# The files one batch-1 decode step passes through on the CPU default (a GGUF file, the step graph), as
# benchmarks/decode_step_files.py traces them: the scheduler's schedule and commit, the worker's execute, the C
# kernels its graph calls. 24 Python + 11 C at eb19f27; a concept split out of a file on that path costs one:
# 13 C at 873b7c2, the KV element's conversions (kv_types.h, q8_0's blocks among them) and the attention's
# per-row helpers (attention_rows.h) split out of paged_attention.c as it passed 400 lines.
MAX_DECODE_STEP_PY = 25
MAX_DECODE_STEP_C = 13


def _engine_files() -> list[Path]:
    return sorted(p for top in ENGINE for p in (ROOT / top).rglob("*.py"))


def _engine_top(module: str) -> str:
    """The engine folder a module name lies in (`tandem.worker.x` -> `worker`)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tandem" and len(parts) > 1 else parts[0]


def _imported_tops(path: Path) -> set[str]:
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops.update(_engine_top(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(_engine_top(node.module))
    return tops & set(ENGINE)


def test_imports_follow_the_folder_rules() -> None:
    wrong = []
    for path in _engine_files():
        top = path.relative_to(ROOT).parts[0]
        for target in sorted(_imported_tops(path) - ALLOWED[top] - {top}):
            wrong.append(f"{path.relative_to(ROOT)} imports {target}/")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle_among_top_level_folders() -> None:
    edges: dict[str, set[str]] = {t: set() for t in ENGINE}
    for path in _engine_files():
        top = path.relative_to(ROOT).parts[0]
        edges[top] |= _imported_tops(path) - {top}

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges[a])

    assert not [t for t in ENGINE if reaches(t, t, {t})]


@pytest.mark.parametrize("variable", ["TANDEM_TRITON", "TANDEM_NO_NATIVE"])
def test_kernel_choice_variables_are_read_in_one_file(variable: str) -> None:
    readers = [
        str(p.relative_to(ROOT))
        for p in _engine_files()
        if any(f"{how}(\"{variable}\"" in p.read_text() or f"{how}('{variable}'" in p.read_text()
               for how in ("environ.get", "getenv", "environ["))
    ]
    assert readers == ["kernels/ops.py"], readers


def test_files_are_small_and_unfolded() -> None:
    """No file over MAX_FILE_LINES, and none made to fit by folding: no `fmt: skip`/`fmt: off`, and ruff holds
    the engine to its line length (E501 is waived only for the texts tests, benchmarks and docs embed)."""
    sizes = {p: len(p.read_text().splitlines()) for p in _engine_files()}
    big = [f"{p.relative_to(ROOT)}: {n}" for p, n in sizes.items() if n > MAX_FILE_LINES]
    assert not big, big
    folded = [str(p.relative_to(ROOT)) for p in _engine_files()
              if re.search(r"#\s*fmt:\s*(skip|off)", p.read_text())]
    assert not folded, folded
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "E501" not in lint.get("ignore", []) and "E" in lint["select"]
    waived = {glob for glob, rules in lint.get("per-file-ignores", {}).items() if "E501" in rules}
    assert waived <= {"tests/**", "benchmarks/**", "docs/**"}, waived


# Names a module defines for its role, the same job in each (a kernel binding's `available`/`build`/`bind`/
# `supports`, a program's `main`, a route group's `install`, a checker's `check`, a runner's `run`).
ROLE_NAMES = {"available", "bind", "build", "supports", "main", "install", "check", "run"}


def test_one_definition_per_concept() -> None:
    """No public class or function name is defined in two engine files, but a role's name and a kernel's
    twins (its reference beside its native or Triton implementation, kernels/ops.py picks)."""
    where: dict[str, list[Path]] = {}
    for path in _engine_files():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not node.name.startswith("_") and node.name not in ROLE_NAMES:
                    where.setdefault(node.name, []).append(path.relative_to(ROOT))

    def twins(paths: list[Path]) -> bool:
        kinds = [p.parts[1] for p in paths if p.parts[0] == "kernels" and len(p.parts) > 2]
        return len(kinds) == len(paths) == 2 and "reference" in kinds

    twice = {name: [str(p) for p in paths] for name, paths in where.items() if len(paths) > 1 and not twins(paths)}
    assert twice == {}


def test_layers_leave_every_kernel_choice_to_the_ops() -> None:
    """A layer or model holds the weight forms and calls the kernels its Ops give it (kernels/ops.py,
    kernels/weight_forms.py): it imports no kernel implementation and tests no device or capability."""
    wrong = []
    for path in sorted((ROOT / "worker" / "layers").rglob("*.py")) + sorted((ROOT / "worker" / "models").rglob("*.py")):
        text = path.read_text()
        for needle in ("kernels.native", "kernels.cpu_linear", "kernels.triton", "kernels.reference",
                       ".device.type", "available()"):
            if needle in text:
                wrong.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not wrong, wrong


def test_a_decode_step_passes_through_few_files(tiny_model, tmp_path: Path) -> None:
    from tandem.benchmarks.decode_step_files import decode_step_files
    from tests.gguf_files import write_gguf

    path = tmp_path / "llama-Q4_1.gguf"
    write_gguf(tiny_model("llama"), path, "Q4_1")
    py, c = decode_step_files(str(path))
    assert c, "the CPU default decodes through the step graph (its C kernels built)"
    assert len(py) <= MAX_DECODE_STEP_PY, py
    assert len(c) <= MAX_DECODE_STEP_C, c
    assert "worker/models/llama.py" in py and "kernels/csrc/quant_linear.c" in c  # the trace sees the step
