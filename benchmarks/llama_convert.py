"""llama.cpp's own GGUF converter (`convert_hf_to_gguf.py` with its conversion/ package and gguf-py) run on a
Hugging Face directory, and its `llama-quantize`: how llama.cpp's users make their files, so the engine is
measured and tested on exactly those. The converter comes from a llama.cpp source tree: `make test-slow`
unpacks one into the venv (VENV/llama.cpp), and a build made by build-llamacpp.sh keeps its sources
(DIR/src/vendor/llama.cpp)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tandem.benchmarks.llama_cpp import find_binary

VENV_CONVERTER = Path(sys.prefix) / "llama.cpp"

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


def find_converter(build: Path | None = None) -> Path:
    """The directory holding convert_hf_to_gguf.py: a llama.cpp build's sources, else the venv's copy."""
    for cand in ([build / "src" / "vendor" / "llama.cpp", build] if build else []) + [VENV_CONVERTER]:
        if (cand / "convert_hf_to_gguf.py").is_file():
            return cand
    raise FileNotFoundError(f"no convert_hf_to_gguf.py in {build or ''} or {VENV_CONVERTER} (make test-slow "
                            "unpacks one into the venv)")


def convert(model_dir: Path, out: Path, outtype: str, converter: Path | None = None,
            timeout_s: float = 3600) -> Path:
    """`convert_hf_to_gguf.py model_dir --outtype outtype --outfile out` (outtype: f32, f16, bf16, q8_0)."""
    root = converter or find_converter()
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(root), str(model_dir), "--outtype", outtype,
                        "--outfile", str(out)], capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir}:\n{r.stderr[-3000:]}")
    return out


def quantize(build: Path, src: Path, out: Path, qtype: str, threads: int) -> Path:
    """`llama-quantize src out qtype threads` (qtype: Q4_0, Q4_K_M, ...; src: a Q8_0 / BF16 / F16 file)."""
    exe = find_binary(build, "llama-quantize")
    r = subprocess.run([str(exe), str(src), str(out), qtype, str(threads)], capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama-quantize {qtype} failed:\n{r.stderr[-3000:]}")
    return out
