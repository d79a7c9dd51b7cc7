"""Linear layers laid out for tensor parallelism.

Column-parallel layers split the output features across ranks, row-parallel layers split the input
features (and sum the partial results with an all-reduce). Weights arrive as a full tensor or as a lazy
safetensors slice: both support ``src[a:b]`` / ``src[:, a:b]``, so a rank reads only its own rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.kernels.linear_product import linear_product
from tandem.kernels.weight_forms import QuantRows, QuantWeight, WeightForms, standalone_forms
from tandem.worker.gguf_weights import GGUFBlocks

if TYPE_CHECKING:
    from tandem.kernels.ops import Ops
    from tandem.worker.layers.lora import LoraSlots


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def full_tensor(src: Any) -> torch.Tensor:
    """A whole checkpoint tensor from a tensor or a safetensors slice."""
    return src if isinstance(src, torch.Tensor) else src[:]


class PackableLinear(nn.Module):
    """A linear layer whose weight, once loaded, runs on CPU from a GGUF file's quantized blocks (the C
    kernel, kernels/native/quant_linear.py: `weight` is then None), or as a float weight the same kernel
    takes for a few rows (`dense`, the very tensor torch multiplies with for more), or through oneDNN's
    packed copy (cpu_linear.py) where the C kernels are not built."""

    weight: nn.Parameter | None
    packed: torch.Tensor | None = None
    quant: QuantWeight | QuantRows | None = None
    dense: QuantWeight | None = None
    # the product from blocks takes int8 activations (the worker's Ops: --cpu-int8-activations)
    int8_activations: bool = False
    ops: Ops | None = None  # the worker's: its `linear` runs the product (None: a layer made alone)
    forms: WeightForms | None = None  # the form the weight takes: the ops' (kernels/weight_forms.py)
    lora: LoraSlots | None = None  # adapters' slots, where an adapter may target the layer (layers/lora.py)
    in_features: int
    out_features: int  # this rank's
    # rows offset -> that part's GGUF blocks, until finish_loading packs (or dequantizes) them
    _blocks: dict[int, GGUFBlocks]

    def use_ops(self, ops: Ops | None) -> None:
        self.ops = ops
        self.int8_activations = ops is not None and ops.int8_activations
        # a layer made without ops: the C kernels' forms where they are built
        self.forms = standalone_forms() if ops is None else ops.weights

    def take_blocks(self, blocks: GGUFBlocks, offset: int) -> None:
        if not hasattr(self, "_blocks"):
            self._blocks = {}
        self._blocks[offset] = blocks

    def finish_loading(self) -> None:
        """Once every part is in: the kernel's layout when all of the weight came as blocks (the plain
        weight is freed), one QuantWeight per run of parts of one type (a QuantRows of them when the types
        differ, as a Q4_K_M file's q/k and v do); otherwise the blocks that came are dequantized into the
        weight."""
        parts = getattr(self, "_blocks", None)
        if not parts:
            return
        self._blocks = {}
        order = sorted(parts)
        rows = sum(parts[o].shape[0] for o in order)
        inputs = {parts[o].in_features for o in order}
        if len(inputs) == 1 and rows == self.weight.shape[0] and order == _contiguous(parts, order):
            runs: list[list[int]] = []
            for o in order:
                if runs and parts[runs[-1][0]].qtype == parts[o].qtype:
                    runs[-1].append(o)
                else:
                    runs.append([o])
            try:
                # the parts are read where they lie (the file's mapping), not joined first: a copy's fresh
                # pages cost as much as the repack
                packed = [self.forms.blocks([parts[o].raw for o in run], parts[run[0]].qtype, *inputs)
                          for run in runs]
            except ValueError:
                pass  # a type or scale the kernel does not take: dequantized below
            else:
                self.quant = packed[0] if len(packed) == 1 else QuantRows(tuple(packed))
                self.weight = None
                return
        for o in order:
            self.weight.data[o : o + parts[o].shape[0]].copy_(parts[o].dequantize())

    def pack_for_cpu(self, weight_dtype: torch.dtype | None = None) -> None:
        """A float32 model's weight on CPU in the form the ops' kernels take (WeightForms.float_weight)."""
        w = self.weight
        if not self.forms.takes_float(w, weight_dtype):
            return
        data = w.data
        weight, self.dense, self.packed = self.forms.float_weight(data, weight_dtype)
        if weight is None:
            self.weight = None
        elif weight is not data:
            self.weight = nn.Parameter(weight, requires_grad=False)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        run = linear_product if self.ops is None else self.ops.linear
        y = run(x, self.quant, self.dense, self.weight, self.packed, bias)
        lora = self.lora
        if lora is not None and lora.ctx.groups:  # only a worker's model (which has its ops) takes adapters
            self.ops.lora_add(y, x, lora.a, lora.b, lora.ctx.groups, lora.cols, lora.ranks)
        return y


def _contiguous(parts: dict[int, GGUFBlocks], order: list[int]) -> list[int]:
    """The offsets the parts would have if laid end to end from 0 (equal to `order` when they tile the
    rows)."""
    out, at = [], 0
    for o in order:
        out.append(at)
        at += parts[o].shape[0]
    return out


class ColumnParallelLinear(PackableLinear):
    """``y = x @ W.T + b`` where W stacks several logical outputs (q/k/v or gate/up) row-wise.

    Each logical output of size ``output_sizes[i]`` is split evenly over the ranks and rank r keeps slice r
    of every one of them, so every rank's fused output is laid out ``[q_r, k_r, v_r]``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
        ops: Ops | None = None,
    ) -> None:
        super().__init__()
        self.use_ops(ops)
        if any(s % tp_size for s in output_sizes):
            raise ValueError(f"output sizes {output_sizes} not divisible by tp_size={tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        sizes = [s // tp_size for s in output_sizes]
        self.full_sizes = list(output_sizes)  # each logical output's, over all ranks
        self._init_shards(input_size, sizes, [tp_rank * n for n in sizes], bias, dtype, device)

    def _init_shards(
        self, input_size: int, sizes: list[int], starts: list[int], bias: bool, dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        # shard i: rows [starts[i], starts[i] + sizes[i]) of logical output i, at shard_offsets[i] here.
        self.shard_sizes, self.shard_starts = sizes, starts
        self.shard_offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.in_features, self.out_features = input_size, sum(sizes)
        self.weight = _param((sum(sizes), input_size), dtype, device)
        self.bias = _param((sum(sizes),), dtype, device) if bias else None

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        """Copy this rank's rows of the checkpoint tensor (full or lazy slice) of logical output `shard`."""
        n, off, start = self.shard_sizes[shard], self.shard_offsets[shard], self.shard_starts[shard]
        part = tensor[start : start + n]
        if isinstance(part, GGUFBlocks):
            self.take_blocks(part, off)
        else:
            getattr(self, param).data[off : off + n].copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads. With fewer KV heads than ranks the KV heads are replicated:
    rank r keeps KV head ``r * num_kv_heads // tp_size``, the one its query heads attend with."""

    def __init__(
        self,
        input_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
        ops: Ops | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.use_ops(ops)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_heads, self.num_kv_heads = local_heads(num_heads, num_kv_heads, tp_size)
        replicated = num_kv_heads < tp_size
        kv_start = tp_rank * num_kv_heads // tp_size if replicated else tp_rank * self.num_kv_heads
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        starts = [tp_rank * q, kv_start * head_dim, kv_start * head_dim]
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self._init_shards(input_size, [q, kv, kv], starts, bias, dtype, device)


def local_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds; KV heads fewer than ranks are replicated (1 per rank)."""
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads={num_heads} not divisible by tp_size={tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} not divisible by tp_size={tp_size}")
        return num_heads // tp_size, num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size={tp_size} not a multiple of num_key_value_heads={num_kv_heads}")
    return num_heads // tp_size, 1


class RowParallelLinear(PackableLinear):
    """``y = x @ W.T + b`` with W's input features split over ranks; the partial outputs are summed."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
        ops: Ops | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.use_ops(ops)
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} not divisible by tp_size={tp_size}")
        # reduce=False: the caller sums this partial output with others first (an MoE layer's shared expert)
        self.tp_rank, self.tp_size, self.reduce = tp_rank, tp_size, reduce
        self.shard_size = input_size // tp_size
        self.in_features, self.out_features = self.shard_size, output_size
        self.weight = _param((output_size, self.shard_size), dtype, device)
        self.bias = _param((output_size,), dtype, device) if bias else None

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        if param == "bias":  # the bias is not split; only rank 0 adds it (see forward)
            self.bias.data.copy_(full_tensor(tensor))
        else:
            a = self.tp_rank * self.shard_size
            part = tensor[:, a : a + self.shard_size]
            if isinstance(part, GGUFBlocks):
                self.take_blocks(part, 0)
            else:
                self.weight.data.copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Adding the bias on one rank only keeps it counted once after the all-reduce.
        out = self.product(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1 and self.reduce:
            dist.all_reduce(out)
        return out
