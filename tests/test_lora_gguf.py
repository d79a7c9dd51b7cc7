"""LoRA adapters in llama.cpp's GGUF format: a PEFT adapter converted by llama.cpp's own
convert_lora_to_gguf.py, served on a GGUF base, gives PEFT's tokens on transformers' dequantization of the
same base (llama's q/k rows come interleaved from the converter: undone as the base's are); a GGUF file that
is not such an adapter, or one for another model, is a LoraError naming its field."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import AsyncClient, SamplingParams
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.lora import LoraError, LoraModule, check_lora_shapes, read_lora
from tandem.protocol.model_config import read_model_config
from tests.test_lora import N, _adapter, _check, _peft_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _bf16_exact(adapter: Path) -> Path:
    """The adapter's weights rounded to bfloat16's values (kept float32): a bf16 file holds them exactly."""
    f = adapter / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16).float() for k, v in load_file(f).items()}, f)
    return adapter


@pytest.mark.slow
# transformers' GGUF reader takes a Qwen3 file's head size from hidden / heads, which the tiny model's is not:
# its base is written in F32 and PEFT runs on the directory it came from (the same weights)
@pytest.mark.parametrize("arch,outtype,qtype", [("llama", "f32", "Q8_0"), ("llama", "bf16", "Q8_0"),
                                                ("qwen3", "f32", "F32")])
def test_a_llamacpp_lora_file_on_a_gguf_base_is_peft(arch: str, outtype: str, qtype: str, tiny_model,
                                                      tmp_path) -> None:
    from tests.gguf_files import write_gguf
    from tests.llamacpp_converter import llamacpp_convert_lora

    base = tiny_model(arch)
    adapter = _bf16_exact(_adapter(base, tmp_path / "a", 7, 8, ALL))
    lora = llamacpp_convert_lora(adapter, base, tmp_path / f"a-{outtype}.gguf", outtype)
    gguf = write_gguf(base, tmp_path / f"base-{qtype}.gguf", qtype)
    prompts = [[2, 5, 9, 13, 7, 3], [2, 30, 31, 44, 8]]
    runs = [(p, name) for p in prompts for name in (None, "a")]
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)

    async def serve() -> list[list[int]]:
        async with AsyncClient.launch(str(gguf), dtype="float32", cpu_int8_activations=False,
                                      enable_lora=True) as c:
            with pytest.raises(InvalidRequestError, match="adapter.type") as e:  # a model file, not an adapter
                await c.load_lora("a", str(gguf))
            assert e.value.code == ErrorCode.LORA
            assert await c.load_lora("a", str(lora)) == 1  # at run time, as --lora-modules a=FILE at start
            return [o.token_ids for o in await asyncio.gather(*(c.generate(p, params, lora=n) for p, n in runs))]

    got = asyncio.run(serve())
    for (prompt, name), tokens in zip(runs, got, strict=True):
        ref = _peft_greedy(gguf if qtype != "F32" else base, adapter if name else None, prompt)
        _check(tokens, ref, f"{arch} {outtype} {name}")
    assert got[1] != got[0]  # the adapter changes what the model says


def _write_adapter(path: Path, arch: str, tensors: dict[str, np.ndarray], alpha: float = 16.0,
                   kind: str = "adapter") -> Path:
    """A GGUF file laid out as llama.cpp's LoRA converter lays one (gguf's own writer)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(kind)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_file_that_is_not_an_adapter_for_this_model_names_its_field(tiny_model, tmp_path) -> None:
    from tests.gguf_files import write_gguf

    base = tiny_model("llama")
    model = read_model_config(str(base))
    h, r = model.hidden_size, 4
    a, b = np.ones((r, h), np.float32), np.ones((model.num_attention_heads * model.head_dim, r), np.float32)
    pair = {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    good = _write_adapter(tmp_path / "good.gguf", "llama", pair)
    cfg = read_lora(LoraModule("x", str(good)), 64)
    assert (cfg.rank, cfg.scale, cfg.targets, cfg.gguf_arch) == (4, 4.0, ("q_proj",), "llama")
    check_lora_shapes(cfg, model)
    cases = [
        (write_gguf(base, tmp_path / "model.gguf", "F32"), 64, "adapter.type"),  # a model, not an adapter
        (good, 2, "r"),  # rank 4 above --max-lora-rank 2
        (_write_adapter(tmp_path / "emb.gguf", "llama", {"token_embd.weight.lora_a": a}), 64, "tensors"),
        (_write_adapter(tmp_path / "ranks.gguf", "llama", {**pair, "blk.1.attn_q.weight.lora_a": a[:2]}), 64,
         "r"),
    ]
    for path, max_rank, field in cases:
        with pytest.raises(LoraError) as e:
            read_lora(LoraModule("x", str(path)), max_rank)
        assert e.value.field == field, (path, e.value)
    # read, but made for other models: another architecture, another layer count, another width
    for arch, tensors in [("qwen3", pair), ("llama", {k.replace("blk.0", "blk.9"): v for k, v in pair.items()}),
                          ("llama", {"blk.0.attn_q.weight.lora_a": a[:, :8], "blk.0.attn_q.weight.lora_b": b})]:
        other = read_lora(LoraModule("x", str(_write_adapter(tmp_path / f"{arch}.gguf", arch, tensors))), 64)
        with pytest.raises(LoraError) as e:
            check_lora_shapes(other, model)
        assert e.value.field == "base", e.value
