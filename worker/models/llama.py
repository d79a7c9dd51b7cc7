"""Llama-style decoder: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before RoPE).

Module names follow HF's checkpoint names, except that q/k/v and gate/up are fused; `STACKED` maps the
checkpoint names onto the fused layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tandem.kernels.ops import Ops
from tandem.protocol.model_config import ModelConfig
from tandem.worker.attention_backend import AttentionBackend, select_attention_backend
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.layers import (
    ColumnParallelLinear,
    PackableLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
)

# checkpoint module -> (fused module, shard index within the fused output)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int,
        tp_size: int,
    ):
        super().__init__()
        self.layer_id, self.ops = layer_id, ops
        self.head_dim = d = cfg.head_dim
        tp = {"dtype": dtype, "device": device, "tp_rank": tp_rank, "tp_size": tp_size, "ops": ops}
        # Heads split over ranks; KV heads fewer than ranks are replicated (see QKVParallelLinear).
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.qkv_bias, **tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = d**-0.5
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, cfg.o_bias, **tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ops) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        backend: AttentionBackend,
        plan: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k sit side by side in each qkv row: rotate both heads-sets with one set of ops.
            qk = qkv[:, : self.q_size + self.kv_size].view(
                t, self.num_heads + self.num_kv_heads, self.head_dim
            )
            qk = self.ops.rotary(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:  # Qwen3 normalises each head (with separate weights for q and k) before RoPE
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            q, k = self.ops.rotary(self.q_norm(q), cos, sin), self.ops.rotary(self.k_norm(k), cos, sin)
        o = backend.forward(self.layer_id, q, k, v, kv, plan, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.ops = ops
        if cfg.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported")
        tp = {"dtype": dtype, "device": device, "tp_rank": tp_rank, "tp_size": tp_size, "ops": ops}
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, **tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # CPU float32: one C pass; elsewhere in place on the fresh product (no [T, intermediate] temporaries).
        return self.down_proj(self.ops.silu_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int,
        tp_size: int, mlp: nn.Module,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, dtype, device, ops, tp_rank, tp_size)
        self.mlp = mlp  # the dense SwiGLU, or an MoE layer (worker/models/moe.py)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)

    def forward(self, h: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        # In-place residual adds: h is this forward's own activation (the embedding output onwards).
        x = self.post_attention_layernorm.add_forward(h, self.self_attn(self.input_layernorm(h), *attn_args))
        return h.add_(self.mlp(x))


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int,
        make_mlp: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, device, tp_rank, tp_size, ops
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, device, ops, tp_rank, tp_size, make_mlp(i))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.model = LlamaModel(cfg, dtype, device, ops, tp_rank, tp_size,
                                lambda i: self.make_mlp(cfg, i, dtype, device, ops, tp_rank, tp_size))
        # Tied: the LM head reuses the embedding matrix (this rank's vocab shard), so no lm_head module.
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device, tp_rank, tp_size, ops)
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype, device)
        self.attn_backend = select_attention_backend(ops)

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
        """Layer layer_id's MLP (MoE models override it)."""
        return LlamaMLP(cfg, dtype, device, ops, tp_rank, tp_size)

    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        """Architecture switches for ModelConfig, from the raw HF config."""
        bias = bool(hf.get("attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "qk_norm": False,
        }

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Runs the step's tokens, fills their K/V, returns float32 logits [N, vocab] of
        batch.logits_indices."""
        return self.compute_logits(self.hidden_states(batch, kv))

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """The forward up to the LM head: the final-normed hidden states [N, hidden] of batch.logits_indices
        (what a decode graph captures; its logits are computed outside, so no graph holds a vocab-wide
        output of its own)."""
        plan = self.attn_backend.plan(batch, kv)
        cos, sin = self.rope_tables(batch)
        h = batch.place_images(self.model.embed_tokens(batch.input_ids))
        for layer in self.model.layers:
            h = layer(h, cos, sin, kv, self.attn_backend, plan)
        return self.model.norm(h[batch.logits_indices])  # per-token norm: only the rows we need

    def rope_tables(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotary cos/sin tables."""
        return self.rotary.cos_sin(batch.positions, batch.max_seq_len)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.finish_logits(self.head_logits(h))

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 product [N, vocab] (vocab-parallel: each rank's slice, gathered on every
        rank), before finish_logits."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(h)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the model does to the LM head's float32 output (in place; Gemma's softcap), also after a CPU
        step graph's head node."""
        return logits

    @property
    def transforms_logits(self) -> bool:
        """Whether finish_logits changes the head's output (the step graph's argmax node then cannot run on
        it: it sits before finish_logits)."""
        return type(self).finish_logits is not LlamaForCausalLM.finish_logits

    def rotaries(self) -> list[RotaryEmbedding]:
        """Every RoPE table the forward reads (the graphs grow them to the context before recording)."""
        return [self.rotary]

    def pack_cpu_weights(self, weight_dtype: torch.dtype | None = None) -> None:
        """On CPU in float32, every linear layer's float weight and the LM head's made ready for the C
        kernel (in weight_dtype: bf16 weights under float32 activations, worker/device.py), or swapped for
        oneDNN's packed copy without it (worker/layers/linear.py); elsewhere nothing changes. Call once,
        after load_weights."""
        for module in self.modules():
            if isinstance(module, PackableLinear):
                module.pack_for_cpu(weight_dtype)
        if self.lm_head is None:
            # also the embedding
            self.model.embed_tokens.pack_for_cpu(keep_weight=True, weight_dtype=weight_dtype)
        else:
            self.lm_head.pack_for_cpu(keep_weight=False, weight_dtype=weight_dtype)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named tensors (full, or lazy safetensors slices of which each layer reads only its
        rank's part); raises on unknown names and on anything left unloaded."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            module_path, param = name.rsplit(".", 1)
            parent, _, leaf = module_path.rpartition(".")
            shard = 0
            if leaf in STACKED:
                fused, shard = STACKED[leaf]
                module_path = f"{parent}.{fused}"
            try:
                module = self.get_submodule(module_path)
            except AttributeError:
                raise ValueError(f"unexpected weight {name!r} in checkpoint") from None
            if not hasattr(module, "load_weight") or getattr(module, param, None) is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            module.load_weight(tensor, shard=shard, param=param)
            loaded.add(name)
        missing = self._expected_weight_names() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")
        for module in self.modules():  # layers loaded from GGUF blocks pack them now
            if isinstance(module, PackableLinear):
                module.finish_loading()
        self.model.embed_tokens.finish_loading(head=self.lm_head is None)
        if self.lm_head is not None:
            self.lm_head.finish_loading(head=True)

    def _expected_weight_names(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():
            module_path, param = name.rsplit(".", 1)
            parent, _, leaf = module_path.rpartition(".")
            parts = [ckpt for ckpt, (fused, _) in STACKED.items() if fused == leaf]
            if parts:
                names.update(f"{parent}.{p}.{param}" for p in parts)
            else:
                names.add(name)
        return names


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True}
