"""How many KV slots the pools get: the device pool (an explicit count, or a fraction of free memory) and
the host tier (an explicit count, or a size in GB)."""
from __future__ import annotations

from typing import Any

import psutil
import torch

from protocol.engine_config import EngineConfig


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one token's K/V costs on one rank (which caches only its local KV heads)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    heads = max(1, model_config.num_key_value_heads // tp_size)
    return 2 * model_config.num_hidden_layers * heads * model_config.head_dim * elem


def kv_pool_tokens(
    cfg: EngineConfig, model_config: Any, dtype: torch.dtype, device: torch.device, useful_max: int
) -> int:
    if cfg.kv_cache_tokens is not None:
        return cfg.kv_cache_tokens
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    n = int(free * cfg.kv_memory_fraction) // kv_bytes_per_token(model_config, dtype, cfg.tp_size)
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
