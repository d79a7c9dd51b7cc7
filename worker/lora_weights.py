"""An adapter's weights into a device slot of every layer it targets (worker/layers/lora.py), this rank's part
of each: a column-parallel layer's rows of B, a row-parallel layer's columns of A. Every shape is checked
against the model's before anything is written: an adapter made for another model (hidden size, layer
count, heads) is a LoraError naming the weight, and the slot is left as it was.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from tandem.protocol.architectures import architecture
from tandem.protocol.lora import LoraConfig, LoraError, weight_key
from tandem.protocol.lora_gguf import gguf_lora_tensors
from tandem.protocol.model_config import ModelConfig
from tandem.worker.gguf_weights import unpermute_qk
from tandem.worker.layers.lora import LAYER_OF, lora_layers

Pairs = dict[tuple[str, str], dict[str, torch.Tensor]]  # (layer path, target) -> {"A": .., "B": ..}


def read_adapter(cfg: LoraConfig, model: ModelConfig) -> Pairs:
    """The adapter file's weights, in host memory, in PEFT's form (a GGUF adapter's llama q/k lora_B rows put
    back in HF's order, as its base's weights are)."""
    pairs: Pairs = {}
    heads = {"q_proj": model.num_attention_heads, "k_proj": model.num_key_value_heads}
    permuted = cfg.gguf_arch is not None and architecture(model.architecture).gguf_qk_permuted
    for name, w in _weights(cfg):
        key = weight_key(name)
        if key is None:
            raise LoraError("adapter_model.safetensors", f"{name!r}: not a LoRA weight served here")
        path, _, target, ab = key
        if permuted and ab == "B" and target in heads:
            w = unpermute_qk(w, heads[target])
        pairs.setdefault((path, target), {})[ab] = w
    return pairs


def _weights(cfg: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if cfg.gguf_arch:
        yield from gguf_lora_tensors(cfg)
        return
    with safe_open(str(cfg.weights_file), "pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def load_adapter(model: torch.nn.Module, slot: int, cfg: LoraConfig, pairs: Pairs | None = None) -> None:
    """Fill device slot `slot` of every target layer with the adapter (pairs: its weights read already)."""
    layers = lora_layers(model)
    writes: list[tuple[Any, int, torch.Tensor, torch.Tensor]] = []  # (layer, part, A rows, B rows) to copy
    pairs = pairs if pairs is not None else read_adapter(cfg, model.config)
    for (path, target), ab in sorted(pairs.items()):
        if target not in LAYER_OF:
            raise LoraError("target_modules", f"{target!r}: not a projection this engine serves")
        fused, part = LAYER_OF[target]
        layer = layers.get(f"{path.rpartition('.')[0]}.{fused}")
        if layer is None:
            raise LoraError("base", f"{path}: the model has no such layer (an adapter for another model)")
        if set(ab) != {"A", "B"}:
            raise LoraError("adapter_model.safetensors", f"{path}: lora_A and lora_B do not both come")
        writes.append((layer, part, *_rank_part(layer, part, ab["A"], ab["B"], cfg, path)))
    for layer in layers.values():  # the slot's previous adapter is gone where this one does not write
        layer.lora.a[slot].zero_()
        layer.lora.b[slot].zero_()
        layer.lora.ranks[slot] = cfg.rank if any(w[0] is layer for w in writes) else 0
    for layer, part, a, b in writes:
        s = layer.lora
        r0, (o, n) = part * s.max_rank, s.parts[part]
        s.a[slot, r0 : r0 + cfg.rank].copy_(a)
        s.b[slot, r0 : r0 + cfg.rank, o : o + n].copy_((b * cfg.scale).t())


def _rank_part(layer: Any, part: int, a: torch.Tensor, b: torch.Tensor, cfg: LoraConfig, path: str,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A [r, in] and B [out, r] of one part of the layer, the shapes checked."""
    r = cfg.rank
    column = hasattr(layer, "shard_sizes")
    full_in = layer.in_features * (1 if column else layer.tp_size)
    full_out = layer.full_sizes[part] if column else layer.out_features
    if tuple(a.shape) != (r, full_in) or tuple(b.shape) != (full_out, r):
        raise LoraError("base", f"{path}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the "
                                f"model's layer ([{r}, {full_in}] and [{full_out}, {r}]): an adapter for "
                                "another model, or another r")
    if column:
        start, n = layer.shard_starts[part], layer.shard_sizes[part]
        return a, b[start : start + n]
    k = layer.tp_rank * layer.in_features
    return a[:, k : k + layer.in_features], b
