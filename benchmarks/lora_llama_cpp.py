"""`tandem bench lora --llama-cpp BUILD` on a .gguf base: llama.cpp's server decoding one stream with the
bench's first adapter and without it, on the same file, beside tandem's figures of the same run.

The adapter goes through llama.cpp's own convert_lora_to_gguf.py (float32, the weights tandem serves) and is
applied per request by its scale (0: the base), so both sides run in one server. llama.cpp applies one
adapter set per context, so this is the batch-1 anchor only: it has no figure for streams over several
adapters.
"""
from __future__ import annotations

import json
import statistics
import urllib.request
from pathlib import Path
from typing import Any

from tandem.benchmarks.llama_convert import convert_lora, find_converter
from tandem.benchmarks.llama_cpp import llama_server
from tandem.protocol.gguf_metadata import gguf_metadata_dir


def _decode_tok_s(url: str, prompt: list[int], output_len: int, scale: float) -> float:
    body = {"prompt": prompt, "n_predict": output_len, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False, "lora": [{"id": 0, "scale": scale}]}
    req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return float(json.loads(r.read())["timings"]["predicted_per_second"])


def llama_cpp_decode(build: Path, gguf: str, adapter: Path, prompt: list[int], output_len: int, runs: int,
                     threads: int, tmp: Path) -> dict[str, Any]:
    """llama.cpp's decode tok/s with the adapter and without (alternating, `runs` each) and their medians."""
    lora = convert_lora(adapter, gguf_metadata_dir(gguf), tmp / "adapter.gguf", "f32", find_converter(build))
    res: dict[str, list[float]] = {"decode_base": [], "decode_adapter": []}
    with llama_server(build, gguf, 1, len(prompt) + output_len + 16, threads, extra=("--lora", str(lora))) as url:
        _decode_tok_s(url, prompt, 8, 1.0)  # warm-up
        for _ in range(runs):
            res["decode_base"].append(_decode_tok_s(url, prompt, output_len, 0.0))
            res["decode_adapter"].append(_decode_tok_s(url, prompt, output_len, 1.0))
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"build": str(build), "runs": res, "median": med, "decode_ratio": med["decode_adapter"] /
            med["decode_base"]}
