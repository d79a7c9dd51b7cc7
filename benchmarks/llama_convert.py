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


def convert_lora(adapter_dir: Path, base_dir: Path, out: Path, outtype: str, converter: Path | None = None,
                 timeout_s: float = 600) -> Path:
    """`convert_lora_to_gguf.py adapter_dir --base base_dir --outtype outtype --outfile out`: a PEFT adapter
    as llama.cpp's LoRA GGUF file (outtype: f32, f16, bf16, q8_0)."""
    root = converter or find_converter()
    script = root / "convert_lora_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"no convert_lora_to_gguf.py in {root}")
    driver = f"import runpy, sys; sys.path[:0] = [{str(root)!r}, {str(root / 'gguf-py')!r}]; " \
             f"sys.argv[0] = {str(script)!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", driver, str(adapter_dir), "--base", str(base_dir), "--outtype",
                        outtype, "--outfile", str(out)], capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp's LoRA converter failed on {adapter_dir}:\n{r.stderr[-3000:]}")
    return out


# The vocabulary of one GGUF file given to another, through llama.cpp's own metadata copier
# (gguf-py/gguf/scripts/gguf_new_metadata.py): every tokenizer.* key of the donor, none of the source's others.
_VOCAB_DRIVER = """
import sys
root, src, donor, out = sys.argv[1:5]
sys.path[:0] = [root + "/gguf-py", root + "/gguf-py/gguf/scripts"]
import gguf
from gguf_new_metadata import MetadataDetails, copy_with_new_metadata
reader, vocab = gguf.GGUFReader(src), gguf.GGUFReader(donor)
mine = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
theirs = {k: f for k, f in vocab.fields.items() if k.startswith("tokenizer.")}
def spaced(f):  # SentencePiece's word mark is a space (Gemma's release writes its runs of spaces so)
    return [t.replace("\u2581", " ") for t in f.contents()]
if spaced(mine["tokenizer.ggml.tokens"]) != spaced(theirs["tokenizer.ggml.tokens"]):
    sys.exit(f"{donor}'s tokens are not {src}'s: a vocabulary of another model")
writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents(), endianess=reader.endianess)
new = {}
for k, f in theirs.items():
    sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
    if k in mine:
        new[k] = MetadataDetails(f.types[0], f.contents(), sub_type=sub)
    else:
        writer.add_key_value(k, f.contents(), f.types[0], sub_type=sub)
copy_with_new_metadata(reader, writer, new, [k for k in mine if k not in theirs])
"""


def replace_vocab(src: Path, donor: Path, out: Path, converter: Path | None = None) -> Path:
    """src with donor's tokenizer metadata (the same tokens, checked): a Gemma HF directory without
    tokenizer.model (one `tandem convert` wrote) gives the converter only tokenizer.json, from which it writes
    a BPE ("gpt2") vocabulary that transformers' GGUF reader, and so the engine, cannot load; the release
    file's is the SentencePiece one the converter writes from tokenizer.model."""
    root = converter or find_converter()
    r = subprocess.run([sys.executable, "-c", _VOCAB_DRIVER, str(root), str(src), str(donor), str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"copying {donor}'s vocabulary into {src} failed:\n{r.stderr[-3000:]}")
    return out


def quantize(build: Path, src: Path, out: Path, qtype: str, threads: int) -> Path:
    """`llama-quantize src out qtype threads` (qtype: Q4_0, Q4_K_M, ...; src: a Q8_0 / BF16 / F16 file)."""
    exe = find_binary(build, "llama-quantize")
    r = subprocess.run([str(exe), str(src), str(out), qtype, str(threads)], capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama-quantize {qtype} failed:\n{r.stderr[-3000:]}")
    return out
