"""llama.cpp's own GGUF converter, `convert_hf_to_gguf.py` (with its conversion/ package and gguf-py), as
`make test-slow` unpacks it from the llama-cpp-python sdist into the venv: a writer of GGUF files that is
neither the engine's nor the tests' own (tests/gguf_files.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CONVERTER = Path(sys.prefix) / "llama.cpp"

# The converter names the file's pre-tokenizer by hashing the tokenizer's output on a fixed text against the
# models llama.cpp knows; a made model's tokenizer is none of them. The name only picks llama.cpp's own
# pre-tokenizer regex (the engine and transformers tokenize with the tokenizer the file carries), so it is
# told "default"; everything else runs as `python convert_hf_to_gguf.py` would.
_DRIVER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
sys.argv[0] = root + "/convert_hf_to_gguf.py"
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llamacpp_convert(model_dir: Path, out: Path, outtype: str) -> Path:
    """`convert_hf_to_gguf.py model_dir --outtype outtype --outfile out` (outtype: f32, f16, bf16, q8_0)."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter is not in {CONVERTER}: `make test-slow` unpacks it there")
    r = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(CONVERTER), str(model_dir), "--outtype", outtype,
         "--outfile", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0 and out.is_file(), f"llama.cpp's converter failed:\n{r.stderr[-3000:]}"
    return out
