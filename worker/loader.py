"""Build a model from a HF-format directory (config.json + *.safetensors, read with safetensors) or from a
GGUF file (see worker/gguf_weights.py: on CPU in float32 its 4- and 8-bit weights stay quantized for
kernels/native/quant_linear.py; otherwise they are dequantized while loading)."""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.kernels.native.quant_linear import GGUF_BLOCKS
from tandem.kernels.ops import Ops, resolve_ops
from tandem.protocol.architectures import gguf_architecture
from tandem.protocol.gguf_metadata import is_gguf
from tandem.protocol.gguf_tensor_index import gguf_tensor_index
from tandem.protocol.mmproj import TEXT_FILE, projector_file
from tandem.protocol.model_config import ModelConfig, read_hf_config
from tandem.worker.gguf_weights import iter_gguf_weights
from tandem.worker.layers.linear import PackableLinear
from tandem.worker.mmproj_weights import iter_mmproj_weights
from tandem.worker.models import CausalLM, get_model_class


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):  # sharded checkpoint: the index names the files
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_weights(model_dir: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs: a layer indexes the slice (``w[a:b]``, ``w[:, a:b]``) and only those
    bytes are read, so a tensor-parallel rank never materialises weights it does not hold."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # safe_open is not a dict
                yield name, f.get_slice(name)


def load_model(
    model: str, dtype: torch.dtype, device: torch.device | str, tp_rank: int = 0, tp_size: int = 1,
    ops: Ops | None = None, weight_dtype: torch.dtype | None = None,
) -> CausalLM:
    """`model`: a HF directory or a .gguf file; ops: the worker's (None: resolve_ops's default for device
    and dtype); weight_dtype: what pack_cpu_weights will be given (the float linear weights are then
    loaded in it directly where the C kernels take them)."""
    ops = ops or resolve_ops(device, dtype)
    hf = read_hf_config(model)
    arch = (hf.get("architectures") or [None])[0]
    cls = get_model_class(arch)
    cfg = ModelConfig.from_hf(hf, **cls.arch_flags(hf))
    m = cls(cfg, dtype, device, ops, tp_rank=tp_rank, tp_size=tp_size)
    if ops.native and weight_dtype not in (None, dtype):
        _load_linear_weights_in(m, weight_dtype)
    if is_gguf(model):
        m.load_weights(iter_gguf_weights(model, cfg, dtype, keep_blocks=quantized_types(ops)))
    elif (proj := projector_file(model)) is not None:  # a GGUF text file and llama.cpp's projector
        text = Path(model) / TEXT_FILE
        arch = gguf_architecture(gguf_tensor_index(text).architecture, text).name
        text_weights = iter_gguf_weights(text, dataclasses.replace(cfg, architecture=arch), dtype,
                                         keep_blocks=quantized_types(ops))
        m.load_weights(itertools.chain(text_weights, iter_mmproj_weights(proj, dtype)))
    else:
        m.load_weights(iter_weights(model))
    return m.eval()


def _load_linear_weights_in(m: CausalLM, weight_dtype: torch.dtype) -> None:
    """Each linear layer's float weight allocated in weight_dtype before it is loaded: the copy from the
    checkpoint rounds as pack_cpu_weights' cast would (to nearest even), without the float32 table first
    (a 1B model's 4 GB of fresh pages: ~10 s of a BF16 file's start here). Layers loaded from blocks never
    touch theirs."""
    for module in m.modules():
        if isinstance(module, PackableLinear) and module.forms.takes_float(module.weight):
            w = module.weight
            module.weight = nn.Parameter(torch.empty(w.shape, dtype=weight_dtype), requires_grad=False)


def quantized_types(ops: Ops) -> frozenset[str]:
    """GGUF block types the model keeps as they are in the file: where the C kernels run (CPU, float32),
    those the quantized kernel takes (kernels/native/quant_linear.py), as llama.cpp runs a quantized file;
    elsewhere none (the weights are dequantized to the model's dtype while loading)."""
    return frozenset(GGUF_BLOCKS) if ops.native else frozenset()
