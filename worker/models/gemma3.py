"""Gemma 3 (text): HF `Gemma3ForCausalLM` / model_type `gemma3_text`, and llama.cpp's `gemma3` GGUF.

The Llama decoder's pieces with Gemma's differences: sliding-window layers (a window of keys, their own RoPE
base and, where the KV cache gives them one, their own KV pool) between global ones; RMSNorm scaling by
(1 + w); four norms a layer (after attention and around the MLP besides the input's); a GeGLU MLP (GELU,
tanh form); embeddings scaled by sqrt(hidden) in the model's dtype; the attention scale from
query_pre_attn_scalar; logits soft-capped when the config says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.kernels.ops import Ops
from tandem.protocol.model_config import ModelConfig
from tandem.worker.attention_backend import select_attention_backend
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.layers import (
    ColumnParallelLinear,
    GemmaRMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
)
from tandem.worker.models.llama import LlamaAttention, LlamaForCausalLM

GELU_TANH = ("gelu_pytorch_tanh",)  # transformers' name for the tanh-form GELU Gemma 3 uses


class Gemma3Attention(LlamaAttention):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int,
        tp_size: int,
    ):
        super().__init__(cfg, layer_id, dtype, device, ops, tp_rank, tp_size)
        d = self.head_dim
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device, ops)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device, ops)
        self.scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        self.window = cfg.sliding_window if cfg.is_sliding(layer_id) else 0


class Gemma3MLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.ops = ops
        if cfg.hidden_act not in GELU_TANH:
            raise NotImplementedError(f"hidden_activation {cfg.hidden_act!r} is not supported (Gemma 3: "
                                      f"{', '.join(GELU_TANH)})")
        tp = {"dtype": dtype, "device": device, "tp_rank": tp_rank, "tp_size": tp_size, "ops": ops}
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], False, **tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int,
        tp_size: int,
    ):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_id, dtype, device, ops, tp_rank, tp_size)
        self.mlp = Gemma3MLP(cfg, dtype, device, ops, tp_rank, tp_size)
        norm = (cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.input_layernorm = GemmaRMSNorm(*norm)
        self.post_attention_layernorm = GemmaRMSNorm(*norm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(*norm)
        self.post_feedforward_layernorm = GemmaRMSNorm(*norm)

    def forward(self, h: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        # The norms sit on each branch's output, before it joins the residual stream h (in place).
        a = self.self_attn(self.input_layernorm(h), *attn_args)
        x = self.pre_feedforward_layernorm.add_forward(h, self.post_attention_layernorm(a))
        return h.add_(self.post_feedforward_layernorm(self.mlp(x)))


class Gemma3Model(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, device, tp_rank, tp_size, ops
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, dtype, device, ops, tp_rank, tp_size)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        nn.Module.__init__(self)
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.model = Gemma3Model(cfg, dtype, device, ops, tp_rank, tp_size)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, device, tp_rank, tp_size, ops)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype, device)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, cfg.local_rope_scaling, dtype,
                                            device) if cfg.has_sliding_layers else None
        self.attn_backend = select_attention_backend(ops)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weights' dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(dtype)

    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True}

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary] + ([self.rotary_local] if self.rotary_local is not None else [])

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        cfg, backend = self.config, self.attn_backend
        plan = backend.plan(batch, kv)
        full = (*self.rotary.cos_sin(batch.positions, batch.max_seq_len), kv, backend, plan)
        local = full
        if self.rotary_local is not None:
            local_plan = backend.plan(batch, kv, cfg.sliding_window, kv.swa_map)
            local = (*self.rotary_local.cos_sin(batch.positions, batch.max_seq_len), kv, backend, local_plan)
        h = batch.place_images(self.model.embed_tokens(batch.input_ids).mul_(self.embed_scale))
        for i, layer in enumerate(self.model.layers):
            h = layer(h, *(local if cfg.is_sliding(i) else full))
        return self.model.norm(h[batch.logits_indices])

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
