"""llama.cpp's own GGUF converter as `make test-slow` unpacks it into the venv (benchmarks/llama_convert.py):
a writer of GGUF files that is neither the engine's nor the tests' own (tests/gguf_files.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.benchmarks.llama_convert import VENV_CONVERTER, convert


def llamacpp_convert(model_dir: Path, out: Path, outtype: str) -> Path:
    """`convert_hf_to_gguf.py model_dir --outtype outtype --outfile out` (outtype: f32, f16, bf16, q8_0)."""
    if not (VENV_CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter is not in {VENV_CONVERTER}: `make test-slow` unpacks it there")
    return convert(model_dir, out, outtype, VENV_CONVERTER, timeout_s=300)
