"""The house rules the layout keeps, checked on the source (docs/architecture.md, "Rules the code keeps").

Every import is read with `ast`, lazy ones inside functions included, so an arrow cannot hide in a
function body."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
# A ratchet, raised only by a feature that lands with its lines counted here: 12,535 at ceb361a, before the
# rooms were built (the move itself had to fit under it); +400 for issue 23's CPU step graph, K-quant
# packing and KV-cache dtype; +69 for --cpu-int8-activations (its option, Ops field, wiring and reference);
# +1223 for issue 25's reasoning parser, Responses API and Anthropic Messages API (frontend/http/); +791 for
# issue 25's priorities and sessions (the policy object, the session store, host locks in the tree, the
# protocol messages, the client's and the HTTP door's calls); +853 for issue 24's mixture of experts
# (Qwen3-MoE, Qwen2-MoE, Mixtral: the MoE layer and models, the C/Triton/torch experts' bindings, GGUF expert
# tensors and metadata, make-model's MoE archs, the step graph's MoE node); +662 for issue 25's embeddings
# (protocol, worker pooling, scheduler, client with priority, /v1/embeddings), the grammar compiler's
# background start with its on-disk TokenizerInfo, and make demo's live streams; +753 for issue 24's Gemma 3
# and sliding-window attention (the model, its GGUF metadata and names, the window in the C, Triton and torch
# attention, the sliding layers' own KV pool in the scheduler and worker, GELU, the step graph's Gemma
# layer and its bf16 norms, make-model's gemma3, pull's assembled chunk wheels); +674 for issue 26's stall
# detection (StepWatch, the launcher's stall report), bounded drains (StopPlan, Drain/Drained, POST /drain), the
# launcher's reaper, and the memory bounds at the HTTP door and in the grammar cache; +90 for issue 23's
# one-region replay (the recorder's int8 scratch and LM head node, the kernels' part bindings), serve's stdout
# announcements read in one place (and waited for), and the client's DeathWatch (no false death before the
# first connect); +120 for issue 26's heap keeper (the worker's periodic malloc_trim, its mallinfo2 sample
# carried to the engine's stats, --heap-trim-period-s); +25 for the grammar cache making room before a
# compiled grammar is handed out (the 60-minute soak saw it one grammar past its bound, twice, for a moment);
# +110 for issue 23's float weights in the C kernel (dense_rows.h, one weight a layer for the kernel and torch,
# bf16 weights under float32 activations by `--dtype auto` on CPU, float models in the step graph); +80 for
# its greedy argmax node (argmax.c and its binding, the runner taking the replay's tokens), and the layers
# following the ops' choice of C kernels (TANDEM_NO_NATIVE); +110 for a worker's failure reported to the
# launcher, which names its cause (a killed tensor-parallel peer it only echoes: CI saw the echo win), and a
# client collected unclosed that stops its thread and closes its sockets (left to the collector, they hung it);
# +400 for issue 35's one namespace (tandem/ and its public API) and issue 36's bounded connects, the
# configuration checked before spawning (protocol/model_fit.py), the admin key and the OpenAPI error answers, the fuzzer's fixes;
# +100 for the GGUF tensor index (a worker's start parses no metadata: Gemma 3 270M's launch 20 -> 6 s);
# +300 for issue 37's step recorder (the graph recorded from the forward; its nodes' arguments by name).
MAX_ENGINE_LINES = 19_300


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


def test_files_are_small_and_the_engine_does_not_grow() -> None:
    sizes = {p: len(p.read_text().splitlines()) for p in _engine_files()}
    big = [f"{p.relative_to(ROOT)}: {n}" for p, n in sizes.items() if n > MAX_FILE_LINES]
    assert not big, big
    assert sum(sizes.values()) <= MAX_ENGINE_LINES, sum(sizes.values())
