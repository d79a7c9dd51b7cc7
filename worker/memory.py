"""How many KV slots the pools get: the device pool (an explicit count, or a fraction of free memory) and
the host tier (an explicit count, or a size in GB)."""
from __future__ import annotations

from typing import Any

import psutil
import torch

from tandem.kernels.reference.kv_quant import pool_width
from tandem.protocol.engine_config import EngineConfig


def kv_bytes_per_token(
    model_config: Any, dtype: torch.dtype, tp_size: int = 1, layers: int | None = None
) -> int:
    """Bytes one token's K/V costs on one rank (which caches only its local KV heads), in `layers` layers
    (default: all), in pools of `dtype` (uint8: q8_0, 34 bytes per 32 elements)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    heads = max(1, model_config.num_key_value_heads // tp_size)
    n = model_config.num_hidden_layers if layers is None else layers
    return 2 * n * heads * pool_width(dtype, model_config.head_dim) * elem


def swa_pool_applies(cfg: EngineConfig, model_config: Any) -> bool:
    """Whether the model's sliding-window layers get a KV pool of their own whose windows' leftovers go back
    as requests grow: models that have such layers, unless --no-sliding-window-kv or a host tier (whose
    copies move every layer's KV of a slot together)."""
    return model_config.has_sliding_layers and cfg.sliding_window_kv and not cfg.host_tier


def kv_pool_sizes(
    cfg: EngineConfig, model_config: Any, dtype: torch.dtype, device: torch.device, useful_max: int
) -> tuple[int, int]:
    """(full slots, sliding-window slots; 0: no pool of their own). The sliding pool holds at most what
    every running request's window and a step's tokens can need at once, plus pages (the prefix cache's
    tails are evictable): the memory past that goes to the full pool, which the global layers alone use."""
    if not swa_pool_applies(cfg, model_config):
        return kv_pool_tokens(cfg, model_config, dtype, device, useful_max), 0
    p, window = cfg.page_size, model_config.sliding_window
    cap = cfg.max_running_requests * (window + 2 * p) + 2 * cfg.max_num_batched_tokens + p
    sliding = sum(map(model_config.is_sliding, range(model_config.num_hidden_layers)))
    per_full = kv_bytes_per_token(model_config, dtype, cfg.tp_size, model_config.num_hidden_layers - sliding)
    per_swa = kv_bytes_per_token(model_config, dtype, cfg.tp_size, sliding)
    if cfg.kv_cache_tokens is not None:
        return cfg.kv_cache_tokens, min(cfg.kv_cache_tokens, cap)
    budget = int(_free_bytes(device) * cfg.kv_memory_fraction)
    even = budget // (per_full + per_swa)  # both pools the same size: what a model without the split gets
    swa = min(even, cap)
    full = (budget - swa * per_swa) // max(1, per_full)
    full = max(16, min(full, useful_max))
    return full, max(16, min(swa, full))


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def kv_pool_tokens(
    cfg: EngineConfig, model_config: Any, dtype: torch.dtype, device: torch.device, useful_max: int
) -> int:
    if cfg.kv_cache_tokens is not None:
        return cfg.kv_cache_tokens
    n = int(_free_bytes(device) * cfg.kv_memory_fraction) // kv_bytes_per_token(
        model_config, dtype, cfg.tp_size
    )
    # More slots than every request row can ever use is memory for nothing.
    return max(16, min(n, useful_max))


def host_pool_tokens(cfg: EngineConfig, model_config: Any, dtype: torch.dtype) -> int:
    """The host tier's slots (0: none): --host-kv-tokens, or --host-kv-memory-gb over this rank's KV bytes
    per token at the KV dtype, rounded down to whole pages."""
    if cfg.host_kv_memory_gb is None:
        return cfg.host_kv_tokens
    per_token = kv_bytes_per_token(model_config, dtype, cfg.tp_size)
    want = int(cfg.host_kv_memory_gb * 1e9)
    n = want // per_token // cfg.page_size * cfg.page_size
    if n < cfg.page_size:
        raise ValueError(f"--host-kv-memory-gb {cfg.host_kv_memory_gb} holds no page of KV "
                         f"({per_token} bytes per token, pages of {cfg.page_size} tokens)")
    available = psutil.virtual_memory().available
    if want > available:
        raise ValueError(f"--host-kv-memory-gb {cfg.host_kv_memory_gb} is more than the "
                         f"{available / 1e9:.1f} GB of RAM available")
    return n
