"""llama.cpp's own GGUF converter as `make test-slow` unpacks it into the venv (benchmarks/llama_convert.py):
a writer of GGUF files that is neither the engine's nor the tests' own (tests/gguf_files.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.benchmarks.llama_convert import VENV_CONVERTER, convert, convert_lora


def llamacpp_convert(model_dir: Path, out: Path, outtype: str) -> Path:
    """`convert_hf_to_gguf.py model_dir --outtype outtype --outfile out` (outtype: f32, f16, bf16, q8_0)."""
    if not (VENV_CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter is not in {VENV_CONVERTER}: `make test-slow` unpacks it there")
    return convert(model_dir, out, outtype, VENV_CONVERTER, timeout_s=300)


def llamacpp_convert_lora(adapter_dir: Path, base_dir: Path, out: Path, outtype: str) -> Path:
    """`convert_lora_to_gguf.py adapter_dir --base base_dir --outtype outtype --outfile out`."""
    if not (VENV_CONVERTER / "convert_lora_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's LoRA converter is not in {VENV_CONVERTER}: `make test-slow` unpacks it there")
    return convert_lora(adapter_dir, base_dir, out, outtype, VENV_CONVERTER, timeout_s=300)
