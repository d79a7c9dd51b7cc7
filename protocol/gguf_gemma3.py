"""What a gemma3 GGUF file adds to its config.json (protocol/architectures.py's Gemma 3 entry points here):
llama.cpp's converter keeps Gemma 3's sliding-window layout, local RoPE base and attention scale in metadata
the other architectures do not have."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.protocol.errors import ModelLoadError


def gemma3_gguf_config(meta: Callable[..., Any], cfg: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """What a gemma3 file adds to the config, as llama.cpp reads the same file: sliding-window layers
    (every sixth layer global unless the file gives a pattern), local RoPE base 10,000 unless given, the
    attention scale of head_dim (hidden / heads for the 27B model, whose 62 layers llama.cpp keys it on)."""
    import gguf

    K = gguf.Keys
    n = cfg["num_hidden_layers"]
    pattern = meta(K.Attention.SLIDING_WINDOW_PATTERN, 6)
    if isinstance(pattern, list):  # one flag per layer, true = sliding
        if len(pattern) != n:
            raise ModelLoadError(f"{path}: {len(pattern)} sliding_window_pattern flags for {n} layers")
        types = ["sliding_attention" if f else "full_attention" for f in pattern]
    elif isinstance(pattern, int) and pattern >= 1:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    else:
        raise ModelLoadError(f"{path}: metadata sliding_window_pattern {pattern!r} is not a layer count >= 1")
    window = meta(K.Attention.SLIDING_WINDOW)
    if window is None:
        raise ModelLoadError(f"{path}: metadata key 'gemma3.attention.sliding_window' is missing")
    del cfg["hidden_act"]  # Gemma 3 names it hidden_activation
    extra: dict[str, Any] = {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window),
        "layer_types": types,
        "rope_local_base_freq": float(meta(K.Rope.FREQ_BASE_SWA, 10000.0)),
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"]
        if n == 62
        else cfg["head_dim"],
        "attention_bias": False,
    }
    for key, name in (
        (K.LLM.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping"),
        (K.LLM.ATTN_LOGIT_SOFTCAPPING, "attn_logit_softcapping"),
    ):
        if meta(key) is not None:
            extra[name] = float(meta(key))
    return extra
