"""Maps the engine's top-level folders to `tandem.<folder>` (the metadata is in pyproject.toml).

The folders stay at the repository's top level, but installed they live under one name, `tandem`, so that
no top-level name of ours (`kernels` is Hugging Face's, a transformers dependency) shadows another
distribution. setuptools' `packages.find` cannot add that prefix, hence this file: every folder under an
engine folder that holds Python is found, as `find` did, so a new subpackage cannot be left out."""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
FOLDERS = ("frontend", "scheduler", "worker", "detokenizer", "protocol", "kernels", "launch", "benchmarks")


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = ["tandem"], {"tandem": "tandem"}
    for folder in FOLDERS:
        package_dir[f"tandem.{folder}"] = folder
        for d in sorted([ROOT / folder, *(p for p in (ROOT / folder).rglob("*") if p.is_dir())]):
            if "__pycache__" not in d.parts and any(d.glob("*.py")):
                packages.append(".".join(["tandem", *d.relative_to(ROOT).parts]))
    return packages, package_dir


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "tandem.launch": ["data/*.txt"],
        "tandem.kernels": ["csrc/*.c", "csrc/*.h"],
        "tandem.frontend.http": ["static/*.html"],
    },
)
