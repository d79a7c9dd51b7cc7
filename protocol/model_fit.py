"""Whether an engine configuration can run its model, decided from the config and the model's metadata
before any process starts: `tandem serve` and `Client.launch` print or raise one line naming the field,
instead of spawning every process to end in a worker's traceback. No torch import."""
from __future__ import annotations

import os

import psutil

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.lora import LoraModule, read_lora
from tandem.protocol.model_config import ModelConfig, read_model_config
from tandem.protocol.model_info import ModelInfo, read_model_info

# Bytes of one KV element per --kv-cache-dtype; auto on CPU is the activations' float32 (the widest: the
# estimate below errs towards refusing a pool that would have fit, never the other way). q8_0: a float16
# scale and 32 int8 per block of 32 (kernels/reference/kv_quant.py).
_KV_BYTES = {"auto": 4, "float32": 4, "float16": 2, "bfloat16": 2, "q8_0": 34 / 32}
Q8_0_BLOCK = 32


class ConfigError(ValueError):
    """The configuration cannot run the model; the message names the field."""


def check_model_fits(cfg: EngineConfig) -> ModelInfo:
    """The model's info, once the configuration is known to fit it; else ConfigError (or ModelLoadError for
    a model that cannot be read)."""
    try:
        info = read_model_info(cfg.model, cfg.max_model_len)
    except ModelLoadError:
        raise
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ConfigError(str(e)) from None
    model = read_model_config(cfg.model)
    _check_parallel(cfg.tp_size, model)
    _check_moe(model)
    _check_kv_dtype(cfg, model)
    _check_kv_budget(cfg, model, info.max_model_len)
    for m in cfg.lora_modules:  # each adapter's config (its weights' shapes are checked as they load)
        read_lora(LoraModule.parse(m), cfg.max_lora_rank)
    return info


def _check_parallel(tp: int, m: ModelConfig) -> None:
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"tp_size={tp}: the model's num_attention_heads={m.num_attention_heads} is not divisible by it"
        )
    kv = m.num_key_value_heads
    if kv % tp and tp % kv:  # fewer KV heads than ranks are replicated, so the ranks must share them evenly
        raise ConfigError(
            f"tp_size={tp}: the model's num_key_value_heads={kv} neither divides it nor is divisible by it"
        )
    dense = not m.num_experts or not all(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    widths = [("intermediate_size", m.intermediate_size)] if dense else []
    if m.num_experts:
        widths += [("moe_intermediate_size", m.moe_intermediate_size),
                   ("shared_expert_intermediate_size", m.shared_expert_intermediate_size)]
    for name, width in widths:  # row-parallel MLPs split their width across the ranks
        if width % tp:
            raise ConfigError(f"tp_size={tp}: the model's {name}={width} is not divisible by it")


def _check_moe(m: ModelConfig) -> None:
    if not m.num_experts:
        return
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        raise ConfigError(f"model config num_experts_per_tok={m.num_experts_per_tok}: must be in [1, "
                          f"num_experts={m.num_experts}]")
    if m.decoder_sparse_step < 1:
        raise ConfigError(f"model config decoder_sparse_step={m.decoder_sparse_step}: must be >= 1")
    out = [i for i in m.mlp_only_layers if not 0 <= i < m.num_hidden_layers]
    if out:
        raise ConfigError(
            f"model config mlp_only_layers: layer {out[0]} is outside [0, {m.num_hidden_layers})"
        )


def _check_kv_dtype(cfg: EngineConfig, m: ModelConfig) -> None:
    if cfg.kv_cache_dtype == "q8_0" and m.head_dim % Q8_0_BLOCK:
        raise ConfigError(f"kv_cache_dtype=q8_0 stores blocks of {Q8_0_BLOCK} values of a head: the model's "
                          f"head_dim={m.head_dim} is not a multiple of {Q8_0_BLOCK}")


def _check_kv_budget(cfg: EngineConfig, m: ModelConfig, max_model_len: int) -> None:
    """On CPU, the pool --kv-memory-fraction of the available RAM makes must hold one request at
    max_model_len (on CUDA the worker measures the device's memory). An explicit --kv-cache-tokens is the
    operator's own choice and may be smaller (tight pools retract, and a prompt that can never fit fails
    alone with request_failed.kv_capacity)."""
    fix = "lower --max-model-len or raise --kv-memory-fraction"
    if cfg.kv_cache_tokens is not None:
        return
    if cfg.device == "cuda" or (cfg.device == "auto" and os.path.exists("/proc/driver/nvidia/version")):
        return
    heads = max(1, m.num_key_value_heads // cfg.tp_size)
    per_token = 2 * m.num_hidden_layers * heads * m.head_dim * _KV_BYTES.get(cfg.kv_cache_dtype, 4)
    budget = psutil.virtual_memory().available * cfg.kv_memory_fraction
    tokens = int(budget // per_token)
    if tokens < max_model_len:
        raise ConfigError(f"kv_memory_fraction={cfg.kv_memory_fraction}: {budget / 1e9:.2f} GB of RAM holds "
                          f"{tokens} tokens of KV, not one request at max_model_len={max_model_len}: {fix}")
