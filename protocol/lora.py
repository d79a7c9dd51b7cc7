"""LoRA adapters in PEFT's format: what `--lora-modules name=path` names, read and checked before any weight
is loaded, and the prefix-cache key that keeps one adapter's KV apart from the base's and every other's.

An adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors (`...layers.N.self_attn.q_proj.lora_A.weight` [r, in], `lora_B.weight` [out, r]).
The delta an adapter adds to a target layer's output is x A^T B^T * scale, scale = lora_alpha / r (or
lora_alpha / sqrt(r) with use_rslora). What this engine does not run is refused by field, never ignored:
DoRA, biases, modules_to_save, per-module rank or alpha patterns, targets outside the attention and MLP
projections.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_config import ModelConfig

# the projections an adapter may target (PEFT's names, as every Llama-shaped checkpoint has them)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_WEIGHT = re.compile(
    r"^(?:base_model\.model\.)?(.*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


class LoraError(ModelLoadError):
    """An adapter that cannot be served here; `field` names what is wrong (a config key, `path`, `name`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"LoRA adapter: {field}: {message}")
        self.field = field


@dataclass(frozen=True)
class LoraModule:
    """`name=path` as --lora-modules gives it."""

    name: str
    path: str

    @staticmethod
    def parse(spec: str) -> LoraModule:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise LoraError("lora_modules", f"{spec!r} is not name=path")
        if not NAME.match(name):
            raise LoraError("name", f"{name!r}: letters, digits and . _ : / - only, at most 128")
        return LoraModule(name, path)


@dataclass(frozen=True)
class LoraConfig:
    name: str
    path: Path  # the directory
    rank: int
    scale: float
    targets: tuple[str, ...]  # of TARGETS, those its weights hold
    # a llama.cpp GGUF adapter file's general.architecture (protocol/lora_gguf.py); None: a PEFT directory
    gguf_arch: str | None = None

    @property
    def weights_file(self) -> Path:
        return self.path if self.gguf_arch else self.path / "adapter_model.safetensors"


def read_lora(module: LoraModule, max_rank: int) -> LoraConfig:
    """The adapter's config, checked against what the engine runs (its weights' shapes are checked against the
    model's when they load: worker/lora_weights.py). A path to a GGUF file is llama.cpp's format."""
    from tandem.protocol.lora_gguf import is_gguf_file, read_gguf_lora  # it builds on this file's types

    path = Path(module.path).expanduser()
    if is_gguf_file(path):
        return read_gguf_lora(module, path, max_rank)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraError("path", f"{module.path}: no adapter_config.json there")
    if not (path / "adapter_model.safetensors").is_file():
        raise LoraError("path", f"{module.path}: no adapter_model.safetensors there")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError("adapter_config.json", str(e)) from e
    if not isinstance(cfg, dict):
        raise LoraError("adapter_config.json", "not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError("peft_type", f"{cfg.get('peft_type')!r}: only LORA adapters")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoraError("r", f"{r!r} is not a positive integer")
    if r > max_rank:
        raise LoraError("r", f"rank {r} is above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoraError("lora_alpha", f"{alpha!r} is not a positive number")
    for key, fine in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if cfg.get(key, fine) != fine:
            raise LoraError(key, f"{cfg.get(key)!r}: only {fine!r} is served")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise LoraError(key, "per-module settings are not served")
    targets = cfg.get("target_modules")
    names = {targets} if isinstance(targets, str) else set(targets or [])
    if not isinstance(targets, str) and (bad := sorted(t for t in names if t not in TARGETS)):
        raise LoraError("target_modules", f"{bad}: the model's targets are {', '.join(TARGETS)}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    held = tuple(t for t in TARGETS if isinstance(targets, str) or t in names)
    return LoraConfig(module.name, path, r, float(scale), held)


def weight_key(name: str) -> tuple[str, int, str, str] | None:
    """A weight's checkpoint name -> (the layer's module path, layer index, target, "A" or "B"); None: not a
    LoRA weight."""
    m = _WEIGHT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3), m.group(4))


def lora_key(name: str, generation: int, token: int) -> int:
    """The prefix-cache key of a prompt's first token under an adapter (its load generation included, so a
    reloaded adapter never meets the KV of the one before): negative, apart from every token and image key."""
    h = hashlib.blake2b(f"{name}\0{generation}\0{token}".encode(), digest_size=8).digest()
    return -(1 << 62) - int.from_bytes(h, "little") % (1 << 60)



def target_dims(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) features in the model (A is [r, in], B [out, r])."""
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    h, inter = model.hidden_size, model.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}


def check_lora_shapes(cfg: LoraConfig, model: ModelConfig) -> None:
    """The adapter's weights (their shapes, from the file's header) fit the model: every one a LoRA weight of
    a layer it has, A [r, in] and B [out, r] as its projection's. An adapter for another model (hidden size,
    layer count, heads) is a LoraError naming `base`."""
    from safetensors import safe_open

    from tandem.protocol.architectures import architecture
    from tandem.protocol.lora_gguf import gguf_lora_shapes

    dims = target_dims(model)
    if cfg.gguf_arch:
        base = architecture(model.architecture).gguf_arch
        if cfg.gguf_arch != base:
            raise LoraError("base", f"an adapter for a {cfg.gguf_arch!r} model; this model's GGUF "
                                    f"architecture is {base!r}")
        shapes = gguf_lora_shapes(cfg)
    else:
        try:
            with safe_open(str(cfg.weights_file), "pt") as f:
                shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
        except Exception as e:  # a file safetensors cannot read, whatever its fault
            raise LoraError("adapter_model.safetensors", f"cannot be read: {e}") from None
    if not shapes:
        raise LoraError("adapter_model.safetensors", "holds no weights")
    for name, shape in shapes.items():
        key = weight_key(name)
        if key is None or key[2] not in dims:
            raise LoraError("adapter_model.safetensors", f"{name!r}: not a LoRA weight served here")
        _, layer, target, ab = key
        fan_in, fan_out = dims[target]
        want = [cfg.rank, fan_in] if ab == "A" else [fan_out, cfg.rank]
        if layer >= model.num_hidden_layers or list(shape) != want:
            raise LoraError("base", f"{name} {list(shape)}: the model's layer {layer} of "
                                    f"{model.num_hidden_layers} takes {want} (an adapter for another model?)")
