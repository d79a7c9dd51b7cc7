"""Mixture-of-experts decoders: the Llama-style decoder of llama.py with an MoE MLP (worker/layers/moe.py) in
its sparse layers. Qwen3-MoE (q/k norms, no shared expert), Qwen2-MoE (q/k/v bias, a sigmoid-gated shared
expert) and Mixtral (Llama attention, every layer MoE, top-k weights renormalised).

Expert weights load from a checkpoint's per-expert tensors (Qwen's mlp.experts.N.gate_proj, Mixtral's
block_sparse_moe.experts.N.w1/w3/w2), transformers 5's fused [E, ...] tensors, or a GGUF file's 3-D
ffn_*_exps tensors (worker/gguf_weights.py yields them per expert).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tandem.kernels.ops import Ops
from tandem.protocol.model_config import ModelConfig
from tandem.worker.layers.moe import EXPERT_ALIASES, EXPERT_WEIGHT, FusedMoE
from tandem.worker.models.llama import LlamaForCausalLM, LlamaMLP


class MoEForCausalLM(LlamaForCausalLM):
    def make_mlp(
        self,
        cfg: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        device: Any,
        ops: Ops,
        tp_rank: int,
        tp_size: int,
    ) -> nn.Module:
        if cfg.is_moe_layer(layer_id):
            return FusedMoE(cfg, dtype, device, ops, tp_rank, tp_size)
        return LlamaMLP(cfg, dtype, device, ops, tp_rank, tp_size)

    def moe_layers(self) -> dict[str, FusedMoE]:
        return {f"model.layers.{i}.mlp": layer.mlp for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, FusedMoE)}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """llama.py's loading, with the experts' tensors taken by their layers; raises on any expert weight
        missing as on any other."""
        moe = self.moe_layers()

        def others() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint name
                m = EXPERT_WEIGHT.match(name)
                if m is None:
                    yield name, tensor
                    continue
                layer = moe.get(m[1].rsplit(".", 1)[0])
                if layer is None:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                layer.experts.load(
                    tensor, None if m[2] is None else int(m[2]), EXPERT_ALIASES.get(m[3], m[3])
                )

        super().load_weights(others())
        missing = [f"{path}.experts.{w}" for path, layer in moe.items() for w in layer.experts.missing()]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} expert weights, e.g. {missing[:5]}")
        for layer in moe.values():
            layer.finish_loading()


class Qwen3MoeForCausalLM(MoEForCausalLM):
    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True}


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        return {
            "qkv_bias": bool(hf.get("qkv_bias", True)),
            "o_bias": False,
            "mlp_bias": False,
            "qk_norm": False,
        }


class MixtralForCausalLM(MoEForCausalLM):
    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get("sliding_window"):
            raise NotImplementedError("Mixtral with a sliding attention window is not supported")
        # Mixtral's experts are intermediate_size wide, and its router always renormalises the top k.
        return {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False,
                "moe_intermediate_size": int(hf["intermediate_size"]), "norm_topk_prob": True}
