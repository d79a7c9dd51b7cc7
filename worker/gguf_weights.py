"""Weights from a GGUF file: read with gguf's reader, dequantized by the gguf package (or, on request, kept
as the file's blocks for the CPU kernel of kernels/cpu_quant_linear.py), renamed to the Hugging Face names
the models load, and put back in HF's form where llama.cpp's converter changed them, as the architecture's
entry (protocol/architectures.py) says: llama's Q/K rows in HF order, Gemma's norm weights without the 1
its RMSNorm adds (the file stores 1 + w; HF checkpoints hold w)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tandem.protocol.architectures import GLOBAL_MODULES, Architecture, architecture
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gguf_tensor_index import gguf_tensor_index
from tandem.protocol.model_config import ModelConfig


def gguf_to_hf_names(entry: Architecture, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name (``blk.0.attn_q.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``) of the modules the architecture's entry lists; gguf's own
    name map gives each its GGUF name."""
    import gguf

    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == entry.gguf_arch)
    tmap = gguf.get_tensor_name_map(arch_id, num_layers)
    layers = [f"model.layers.{i}.{m}" for i in range(num_layers) for m in entry.layer_modules]
    hf = list(GLOBAL_MODULES) + layers
    out: dict[str, str] = {}
    for module in hf:
        base = tmap.get_name(module)
        if base is not None:
            for suffix in (".weight", ".bias"):
                out[base + suffix] = module + suffix
    return out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's llama converter, which reorders each head's rows from HF's rotate-half layout
    (first half, second half) to interleaved pairs."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFBlocks:
    """A 2-D weight as the file's quantized blocks: raw uint8 [out_features, in_features / block weights *
    block bytes]. Sliced like a tensor (``w[a:b]`` rows; ``w[:, a:b]`` inputs, which stay blocks when a and b
    fall on block edges and are dequantized otherwise), so tensor-parallel layers take their part as they do
    of a float tensor."""

    raw: np.ndarray
    qtype: str  # GGUF type name, e.g. "Q4_1"
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.in_features

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out, in], or written into `out` (any dtype and device; returned): gguf's dequantization,
        computed in C where it builds (the same floats, bit for bit, many times faster: gguf's numpy took
        0.8 s for a 1B model's embedding table) and then straight into a float32 CPU `out`."""
        from tandem.kernels.native import quant_repack
        from tandem.kernels.native.quant_pack import GGUF_BLOCKS

        if self.qtype in GGUF_BLOCKS and quant_repack.available():
            kind = GGUF_BLOCKS[self.qtype][0]
            direct = (out is not None and out.dtype == torch.float32 and out.device.type == "cpu"
                      and out.shape == self.shape and out.stride(1) == 1)
            w = quant_repack.dequantize_rows(self.raw, kind, self.in_features, out=out if direct else None)
            if out is None or direct:
                return w
        else:
            import gguf

            w = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.qtype])
            w = torch.from_numpy(np.ascontiguousarray(w).reshape(self.shape))
        return w if out is None else out.copy_(w)

    def __getitem__(self, key: Any) -> GGUFBlocks | torch.Tensor:
        if isinstance(key, slice):
            return GGUFBlocks(self.raw[key], self.qtype, self.in_features)
        import gguf

        rows, cols = key
        a, b, step = cols.indices(self.in_features)
        elems, per = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.qtype]]
        if step == 1 and a % elems == 0 and b % elems == 0:
            return GGUFBlocks(self.raw[rows, a // elems * per : b // elems * per], self.qtype, b - a)
        return self.dequantize()[rows, cols]


def unpermute_qk_rows(raw: np.ndarray, n_head: int) -> np.ndarray:
    """unpermute_qk for any array whose rows are the weight's output rows (quantized blocks included)."""
    half = raw.shape[0] // n_head // 2
    return np.ascontiguousarray(
        raw.reshape(n_head, half, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)
    )


def iter_gguf_weights(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    progress: bool | None = None,
    keep_blocks: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """(HF name, tensor in `dtype`) for every tensor, dequantized one at a time; 2-D tensors of a type in
    keep_blocks come as GGUFBlocks instead, and F32, F16 and BF16 matrices in their own type, read from the
    file's mapping (read-only: copy from them). progress: a tqdm bar on stderr (None: only when stderr is a
    terminal)."""
    import gguf

    index = gguf_tensor_index(path)
    index.populate()  # every byte is read below
    entry = architecture(cfg.architecture)
    if entry.gguf_arch != index.architecture:
        raise ModelLoadError(
            f"{path}: a GGUF file of architecture {index.architecture!r} read as {entry.name} "
            f"(whose files are {entry.gguf_arch!r})"
        )
    names = gguf_to_hf_names(entry, cfg.num_hidden_layers)
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    bar = tqdm(index.tensors, desc=f"dequantizing {Path(path).name}", unit="tensor",
               disable=None if progress is None else not progress)
    for t in bar:
        name = names.get(t.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for architecture {entry.name}")
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]
        if module.startswith("mlp.experts."):  # one tensor per expert, as a checkpoint names them
            yield from _per_expert(name, _expert_stack(path, t, keep_blocks))
            continue
        if t.tensor_type.name in keep_blocks and len(t.shape) == 2 and t.data.ndim == 2:
            blocks = GGUFBlocks(np.asarray(t.data), t.tensor_type.name, int(t.shape[0]))
            # a permutation of whole rows: the blocks move as they are
            if entry.gguf_qk_permuted and module in heads:
                blocks = GGUFBlocks(
                    unpermute_qk_rows(blocks.raw, heads[module]), blocks.qtype, blocks.in_features
                )
            yield name, blocks
            continue
        if t.tensor_type.name in _FLOAT_VIEWS and len(t.shape) == 2:
            # read where it lies, in its own type: the layer's copy widens or rounds it to the weight's
            # dtype (gguf's float32 array first would be a 1B BF16 file's 4 GB of fresh pages)
            tensor = _float_view(t)
            if entry.gguf_qk_permuted and module in heads:
                tensor = unpermute_qk(tensor, heads[module]).contiguous()
            yield name, tensor
            continue
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized"
            ) from None
        # GGUF lists dimensions innermost first; torch wants them outermost first.
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if entry.gguf_norm_offset and name.endswith("norm.weight"):
            # in float32, as transformers' GGUF loader does: the model adds the offset back
            w = w - np.float32(entry.gguf_norm_offset)
        tensor = torch.from_numpy(w if w.flags.writeable else np.array(w)).to(dtype)
        if entry.gguf_qk_permuted and module in heads:
            tensor = unpermute_qk(tensor, heads[module]).contiguous()
        yield name, tensor


_FLOAT_VIEWS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _float_view(t: Any) -> torch.Tensor:
    """A float tensor of the file as a torch view of its mapped bytes, [outermost, ..., innermost]. The
    mapping is read-only, which torch warns of once: the loaders only copy from it."""
    raw = np.asarray(t.data).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw.reshape(-1))
    return flat.view(_FLOAT_VIEWS[t.tensor_type.name]).view(tuple(int(d) for d in reversed(t.shape)))


def _expert_stack(path: str | Path, t: Any, keep_blocks: frozenset[str]) -> list[torch.Tensor | GGUFBlocks]:
    """A 3-D ffn_*_exps tensor as its experts' [rows, inputs] weights: views of the file's blocks, or
    float32."""
    import gguf

    if t.tensor_type.name in keep_blocks and t.data.ndim == 3:
        return [
            GGUFBlocks(np.asarray(t.data[e]), t.tensor_type.name, int(t.shape[0]))
            for e in range(t.data.shape[0])
        ]
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized"
        ) from None
    w = torch.from_numpy(np.array(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape))))
    return list(w)


def _per_expert(name: str, experts: list[torch.Tensor | GGUFBlocks]) -> Iterator[tuple[str, Any]]:
    """model.layers.N.mlp.experts.gate_proj.weight -> model.layers.N.mlp.experts.E.gate_proj.weight, each
    E."""
    head, _, which = name.rpartition(".experts.")
    for e, w in enumerate(experts):
        yield f"{head}.experts.{e}.{which}", w
