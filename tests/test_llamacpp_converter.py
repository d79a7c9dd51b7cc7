"""The engine on GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py: its metadata, its
tensor names and layouts, Mixtral as a "llama" file with its Q/K rows permuted, the 3-D expert stacks, Qwen2-
MoE's shared expert and gate, Gemma 3's norm offset, window, local RoPE base, linear scaling and soft cap):
nothing of the engine's conversion nor of the tests' own writer (tests/gguf_files.py) is shared.

- float32 files give transformers' greedy tokens on the made model they were converted from (every weight
  exact), for the three MoE architectures and Gemma 3;
- Q8_0 files give transformers' tokens reading that same .gguf with its own GGUF loader and dequantizer
  (with the model's own config: transformers' mapping leaves a made MoE's expert width and Gemma's pattern
  at its defaults).

A Gemma 3 file cannot say which layers slide (llama.cpp reads every sixth as global), so the Gemma made here
has six layers, a global one last, and keeps the tiny preset's soft cap and RoPE scaling."""
from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import gguf
import pytest

from tandem import SamplingParams
from tandem.launch import model_presets
from tandem.launch.make_model import make_model
from tests.conftest import check_idle_engine
from tests.llamacpp_converter import llamacpp_convert
from tests.reference import assert_parity_floor, gguf_own_config, greedy

pytestmark = pytest.mark.slow  # a converter process and an engine per file
MAX_TOKENS = 16
PROMPT_LENS = (1, 9, 40, 130)  # 40 and 130 run past the Gemma's 16-token window


@pytest.fixture(scope="module")
def made(tiny_model, tmp_path_factory):  # a factory: arch -> the made model's directory
    def get(arch: str) -> Path:
        if arch != "gemma3":
            return tiny_model(arch)
        out = tmp_path_factory.getbasetemp() / "gemma3-six-layers"
        if not (out / "config.json").is_file():
            tiny = model_presets.GEMMA3_SIZES["tiny"]
            with pytest.MonkeyPatch.context() as m:
                m.setitem(model_presets.GEMMA3_SIZES, "tiny", dataclasses.replace(tiny, layers=6, pattern=6))
                make_model("gemma3", "tiny", out, seed=0)
        return out

    return get


def _converted(model_dir: Path, outtype: str, root: Path) -> Path:
    out = llamacpp_convert(model_dir, root / f"{model_dir.name}-{outtype}.gguf", outtype)
    shutil.copy(model_dir / "config.json", gguf_own_config(out))  # the reference's config (see above)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors if t.name.endswith("attn_q.weight")}
    assert kinds == {outtype.upper()}, kinds  # the converter wrote the type asked for
    return out


def _check_tokens(client, reference: Path, what: str) -> None:
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = client.generate_batch(prompts, params, progress=False)
    assert_parity_floor([(o.token_ids, greedy(reference, p, MAX_TOKENS), f"{what} len {len(p)}")
                         for p, o in zip(prompts, outs, strict=True)], max_detours=1)
    check_idle_engine(client)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "gemma3"])
def test_float32_file_gives_transformers_tokens_on_its_source(arch: str, made, launch_client,
                                                              tmp_path) -> None:
    source = made(arch)
    path = _converted(source, "f32", tmp_path)
    if arch != "gemma3":
        assert any(t.name == "blk.0.ffn_gate_exps.weight" for t in gguf.GGUFReader(path).tensors)
    _check_tokens(launch_client(path, max_num_batched_tokens=64), source, f"{arch} f32 (llama.cpp)")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3"])
def test_q8_0_file_gives_transformers_tokens_reading_it(arch: str, made, launch_client, tmp_path) -> None:
    path = _converted(made(arch), "q8_0", tmp_path)
    _check_tokens(launch_client(path, max_num_batched_tokens=64), path, f"{arch} q8_0 (llama.cpp)")
