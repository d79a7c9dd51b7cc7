"""How many KV slots the pool gets: an explicit count, or a fraction of free memory."""
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
