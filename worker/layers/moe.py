"""A mixture-of-experts MLP: a softmax top-k router, SwiGLU experts run as one grouped product, and
(Qwen2-MoE)
a sigmoid-gated shared expert. Module names follow the checkpoints': mlp.gate, mlp.experts,
mlp.shared_expert, mlp.shared_expert_gate.

Where the C kernels run (CPU, float32) the layer is one call of kernels/native/moe.py, the experts' weights
in its float32 panels or in the GGUF file's blocks; elsewhere the router runs in torch and the experts
through the Ops' grouped kernel (Triton on CUDA) or its reference.

Tensor parallelism: each rank holds a slice of every expert's intermediate dimension (gate/up rows, down
columns), as the dense MLP is split, and one all-reduce sums the ranks' partial outputs. Chosen over whole
experts per rank because every rank then does the same work whatever the router picks: with whole experts a
step waits for the rank its tokens favoured (at batch 1, top-2 of 8 experts on 2 ranks, both experts sit on
one rank for 12 of the 28 pairs, so the expected step is 1.43x a sliced one's), and it needs no dispatch of
tokens to ranks. The router is replicated: every rank routes alike, from the same bits.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.kernels.weight_forms import ExpertWeights, WeightForms
from tandem.protocol.model_config import ModelConfig
from tandem.worker.gguf_weights import GGUFBlocks
from tandem.worker.layers.linear import ColumnParallelLinear, RowParallelLinear, full_tensor

if TYPE_CHECKING:
    from tandem.kernels.ops import Ops

# A checkpoint's expert weight: per expert (Qwen's gate/up/down_proj, Mixtral's w1/w3/w2) or all experts in
# one [E, ...] tensor (transformers 5's fused gate_up_proj / down_proj).
EXPERT_WEIGHT = re.compile(
    r"^(.*\.mlp\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|w1|w3|w2|gate_up_proj)"
    r"(?:\.weight)?$"
)
EXPERT_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ReplicatedLinear(nn.Module):
    """A small weight every rank holds whole (the router; the shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        w = tensor.dequantize() if isinstance(tensor, GGUFBlocks) else full_tensor(tensor)
        self.weight.data.copy_(w.reshape(self.weight.shape))  # a GGUF [H] shared-expert gate is [1, H] here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token takes, its partial output left unreduced (the MoE
    layer sums it with the experts' before its one all-reduce)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        tp = {"dtype": dtype, "device": device, "tp_rank": tp_rank, "tp_size": tp_size, "ops": ops}
        self.ops = ops
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], False, **tp)
        self.down_proj = RowParallelLinear(inter, hidden, False, reduce=False, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class Experts(nn.Module):
    """Every expert's gate/up ([E, 2 I, H], this rank's I rows of each) and down ([E, H, I]) weights. Float
    parts are written into float tensors made on first need; GGUF blocks are kept until finish_loading, so a
    quantized file never allocates the float32 experts where the C kernel runs."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device: Any,
        tp_rank: int,
        forms: WeightForms,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.tp_rank = num_experts, hidden, inter, tp_rank
        self.dtype, self.device, self.forms = dtype, device, forms
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.packed13: ExpertWeights | None = None  # the C kernel's layout (native)
        self.packed2: ExpertWeights | None = None
        self._blocks: dict[str, dict[tuple[int, int], GGUFBlocks]] = {"w13": {}, "w2": {}}
        self._loaded: set[tuple[int, str]] = set()

    def _float(self, name: str) -> torch.Tensor:
        if getattr(self, name) is None:
            shape = (2 * self.inter, self.hidden) if name == "w13" else (self.hidden, self.inter)
            setattr(self, name, torch.zeros(self.num_experts, *shape, dtype=self.dtype, device=self.device))
        return getattr(self, name)

    def load(self, tensor: Any, expert: int | None, which: str) -> None:
        """A checkpoint's gate_proj / up_proj / down_proj of one expert ([I, H] / [H, I], full size), or with
        expert None the [E, ...] stack of all (gate_up_proj: each expert's gate rows, then its up rows)."""
        if expert is None:
            for e in range(self.num_experts):
                part = tensor[e : e + 1]
                part = part[0] if isinstance(part, torch.Tensor) else part
                if which == "gate_up_proj":
                    full = part.shape[0] // 2
                    self.load(part[:full], e, "gate_proj")
                    self.load(part[full:], e, "up_proj")
                else:
                    self.load(part, e, which)
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer with {self.num_experts} experts")
        n, a = self.inter, self.tp_rank * self.inter
        if which == "down_proj":
            name, rows, part = "w2", 0, tensor[:, a : a + n]
        else:
            name, rows, part = "w13", (0 if which == "gate_proj" else n), tensor[a : a + n]
        if isinstance(part, GGUFBlocks):
            self._blocks[name][(expert, rows)] = part
        else:
            dst = self._float(name)[expert]
            (dst[rows : rows + n] if name == "w13" else dst).copy_(full_tensor(part))
        self._loaded.add((expert, which))

    def missing(self) -> list[str]:
        return [f"{e}.{w}" for e in range(self.num_experts) for w in ("gate_proj", "up_proj", "down_proj")
                if (e, w) not in self._loaded]

    def finish_loading(self) -> None:
        """Each matrix in the layout its product takes: natively, the file's blocks when every expert's came
        as blocks of one type the kernel takes (else float32 panels); off the C kernels, float tensors (blocks
        dequantized)."""
        for name, parts_per_expert in (("w13", 2), ("w2", 1)):
            blocks = self._blocks[name]
            self._blocks[name] = {}
            packed = self._pack_blocks(blocks, name) if self.forms.native_moe and len(blocks) == (
                self.num_experts * parts_per_expert) else None
            if packed is None:
                for (e, rows), b in blocks.items():
                    w = b.dequantize().to(self.dtype)
                    dst = self._float(name)[e]
                    (dst[rows : rows + w.shape[0]] if name == "w13" else dst).copy_(w)
                packed = self.forms.experts(self._float(name))  # None off the C kernel
            if packed is not None:
                setattr(self, "packed" + name[1:], packed)
                setattr(self, name, None)

    def _pack_blocks(
        self, blocks: dict[tuple[int, int], GGUFBlocks], name: str
    ) -> ExpertWeights | None:
        qtypes = {b.qtype for b in blocks.values()}
        if len(qtypes) != 1:
            return None  # gate and up of different types: float32 panels
        (qtype,) = qtypes
        by_expert: dict[int, list[np.ndarray]] = {}
        for (e, _), b in sorted(blocks.items()):  # an expert's gate rows, then its up rows
            by_expert.setdefault(e, []).append(b.raw)
        k = self.hidden if name == "w13" else self.inter
        try:
            return self.forms.experts([self.forms.blocks(np.concatenate(by_expert[e]), qtype, k)
                                       for e in range(self.num_experts)])
        except ValueError:
            return None  # a type or scale the kernel does not take


class FusedMoE(nn.Module):
    """The MoE MLP of one decoder layer (the module doc)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        e, k, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        if not 0 < k <= e:
            raise ValueError(f"num_experts_per_tok={k} must be between 1 and num_experts={e}")
        if inter % tp_size:
            raise ValueError(f"moe_intermediate_size={inter} not divisible by tp_size={tp_size}")
        if cfg.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported")
        self.ops, self.tp_size = ops, tp_size
        self.top_k, self.renormalize = k, cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, e, dtype, device)
        self.experts = Experts(e, cfg.hidden_size, inter // tp_size, dtype, device, tp_rank, ops.weights)
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = (SharedExpert(cfg.hidden_size, shared, dtype, device, ops, tp_rank, tp_size)
                              if shared else None)
        self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, dtype, device) if shared else None
        self._router: torch.Tensor | None = None  # the router in the C kernel's panels

    @property
    def native(self) -> bool:
        """The layer is one C call (the ops' choice of weight forms)."""
        return self.ops.weights.native_moe

    def finish_loading(self) -> None:
        self.experts.finish_loading()
        self._router = self.ops.weights.router(self.gate.weight.data)  # None off the C kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        if self._router is not None:
            y = self.ops.moe_layer(x, ex.packed13, ex.packed2, self.top_k, self.renormalize, self._router)
        else:
            weights, ids = self.ops.moe_route(self.gate(x), self.top_k, self.renormalize)
            y = self.ops.moe_experts(x, ex.w13, ex.w2, weights, ids)
        if self.shared_expert is not None:
            y.addcmul_(torch.sigmoid(self.shared_expert_gate(x)), self.shared_expert(x))
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
