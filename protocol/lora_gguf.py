"""LoRA adapters in llama.cpp's GGUF format, as its convert_lora_to_gguf.py writes them from PEFT's.

Such a file says general.type "adapter", adapter.type "lora" and adapter.lora.alpha; each target weight is a
pair `blk.N.attn_q.weight.lora_a` [r, in] and `.lora_b` [out, r] (torch's order: PEFT's lora_A and lora_B
under llama.cpp's tensor names, in F32, F16, BF16 or Q8_0). llama.cpp scales a weight's delta by alpha / r
(by 1 where alpha is 0); the file carries no rsLoRA flag, so neither does this reader. The weights are given
PEFT's names here, and the rest of the engine serves them as a PEFT adapter; the one change the converter
makes to them, llama's q/k rows of lora_b interleaved as the base's, is undone where the base's is
(worker/lora_weights.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gguf_metadata import open_gguf
from tandem.protocol.lora import TARGETS, LoraConfig, LoraError, LoraModule

_MLP = ("gate_proj", "up_proj", "down_proj")
_MODULES = tuple(f"{'mlp' if t in _MLP else 'self_attn'}.{t}" for t in TARGETS)
_SUFFIX = {".weight.lora_a": "A", ".weight.lora_b": "B"}


def is_gguf_file(path: Path) -> bool:
    """A file (not an adapter directory) that starts as a GGUF file does."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _reader(path: Path) -> Any:
    try:
        return open_gguf(path)
    except ModelLoadError as e:
        raise LoraError("path", str(e)) from None


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _peft_names(reader: Any, arch: str, path: Path) -> dict[str, str]:
    """Each tensor's name -> the name PEFT gives the same weight; a tensor of no served target is an error."""
    import gguf

    arch_id = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    if arch_id is None:
        raise LoraError("general.architecture", f"{arch!r}: not an architecture llama.cpp's files name")
    blocks = [int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")]
    tmap = gguf.get_tensor_name_map(arch_id, max(blocks, default=-1) + 1)
    peft: dict[str, str] = {}
    for i in range(max(blocks, default=-1) + 1):
        for module in _MODULES:
            base = tmap.get_name(f"model.layers.{i}.{module}")
            for suffix, ab in _SUFFIX.items():
                if base is not None:
                    peft[base + suffix] = f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"
    names = {}
    for t in reader.tensors:
        if t.name not in peft:
            raise LoraError("tensors", f"{path}: {t.name!r} is not a LoRA weight served here (targets: "
                                       f"{', '.join(TARGETS)})")
        names[t.name] = peft[t.name]
    if not names:
        raise LoraError("tensors", f"{path}: the file holds no weights")
    return names


def read_gguf_lora(module: LoraModule, path: Path, max_rank: int) -> LoraConfig:
    """The adapter's config from the file's metadata and its tensors' shapes."""
    reader = _reader(path)
    if _field(reader, "general.type") != "adapter" or _field(reader, "adapter.type") != "lora":
        raise LoraError("adapter.type", f"{module.path}: a GGUF file but not a LoRA adapter (general.type "
                                        f"{_field(reader, 'general.type')!r}, adapter.type "
                                        f"{_field(reader, 'adapter.type')!r})")
    arch = _field(reader, "general.architecture")
    names = _peft_names(reader, str(arch), path)
    # GGUF lists dimensions innermost first: lora_a is [in, r]
    ranks = {int(t.shape[1]) for t in reader.tensors if t.name.endswith(".lora_a") and len(t.shape) == 2}
    if len(ranks) != 1:
        raise LoraError("r", f"{module.path}: ranks {sorted(ranks)}: one rank for every weight is served")
    r = ranks.pop()
    if r > max_rank:
        raise LoraError("r", f"rank {r} is above --max-lora-rank {max_rank}")
    alpha = _field(reader, "adapter.lora.alpha") or 0.0
    if not isinstance(alpha, int | float) or alpha < 0:
        raise LoraError("adapter.lora.alpha", f"{alpha!r} is not a number >= 0")
    held = {n.split(".")[-3] for n in names.values()}
    return LoraConfig(module.name, path, r, float(alpha) / r if alpha else 1.0,
                      tuple(t for t in TARGETS if t in held), gguf_arch=str(arch))


def gguf_lora_shapes(cfg: LoraConfig) -> dict[str, list[int]]:
    """Each weight's PEFT name -> its shape, outermost first (from the header: nothing is dequantized)."""
    reader = _reader(cfg.path)
    names = _peft_names(reader, str(cfg.gguf_arch), cfg.path)
    return {names[t.name]: [int(d) for d in reversed(t.shape)] for t in reader.tensors}


def gguf_lora_tensors(cfg: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight's PEFT name and its values in float32, as the file holds them (llama's q/k lora_b rows
    still interleaved)."""
    import gguf

    reader = _reader(cfg.path)
    names = _peft_names(reader, str(cfg.gguf_arch), cfg.path)
    for t in reader.tensors:
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise LoraError("tensors", f"{cfg.path}: {t.name!r} has type {t.tensor_type.name}, which cannot "
                                       "be dequantized") from None
        yield names[t.name], torch.from_numpy(w.reshape([int(d) for d in reversed(t.shape)]).copy()).float()
