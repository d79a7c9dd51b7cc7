"""What both benchmarks share: seeded prompts, the transformers baseline model, engine counter deltas."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tandem.kernels.native.cpu_caps import usable_cores
from tandem.protocol.engine_stats import EngineStats
from tandem.protocol.gguf_metadata import is_gguf
from tandem.protocol.model_config import metadata_dir
from tandem.protocol.model_info import read_model_info


def parse_range(text: str) -> tuple[int, int]:
    """'64:512' -> (64, 512); '128' -> (128, 128). Both ends inclusive."""
    lo_s, _, hi_s = text.partition(":")
    lo, hi = int(lo_s), int(hi_s or lo_s)
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {text!r}: need 1 <= low <= high")
    return lo, hi


def usable_token_ids(model_dir: str | Path) -> list[int]:
    """Ids a prompt may hold: inside both the model's and the tokenizer's vocab, no special tokens."""
    info = read_model_info(model_dir)
    limit = info.vocab_size
    special = set(info.eos_token_ids)
    tok_path = metadata_dir(model_dir) / "tokenizer.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text(encoding="utf-8"))
        added = tok.get("added_tokens") or []
        special |= {int(t["id"]) for t in added if t.get("special")}
        # Ids past the tokenizer's vocab would not detokenize; real checkpoints often pad the embedding.
        tok_size = len((tok.get("model") or {}).get("vocab") or {}) + len(added)
        if tok_size:
            limit = min(limit, tok_size)
    ids = [i for i in range(limit) if i not in special]
    if not ids:
        raise ValueError(f"{model_dir}: no non-special token ids to draw prompts from")
    return ids


def random_prompts(model_dir: str | Path, n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """n prompts, lengths uniform in [low, high], ids uniform over the usable vocabulary."""
    ids = usable_token_ids(model_dir)
    rng = random.Random(seed)
    out: list[list[int]] = []
    for _ in range(n):
        length = rng.randint(*lengths)
        out.append([rng.choice(ids) for _ in range(length)])
    return out


def load_hf_model(model_dir: str | Path) -> Any:
    """The transformers reference in fp32, eval mode, using every core of this process."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the benchmark's report readable
    torch.set_num_threads(usable_cores())
    p = Path(model_dir)
    # transformers dequantizes a GGUF itself (the reference stays independent of our loader).
    gguf = {"gguf_file": p.name} if is_gguf(p) else {}
    model = AutoModelForCausalLM.from_pretrained(str(p.parent if gguf else p), dtype=torch.float32, **gguf)
    model.eval()
    return model


def stats_delta(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """Counters over the timed section, per step where that is what makes them comparable."""
    steps = after.steps - before.steps
    per_step = 1000.0 / steps if steps else 0.0
    return {
        "steps": steps,
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "decode_tokens": after.decode_tokens - before.decode_tokens,
        "retractions": after.retractions - before.retractions,
        "schedule_ms_per_step": (after.schedule_s - before.schedule_s) * per_step,
        "worker_busy_ms_per_step": (after.worker_busy_s - before.worker_busy_s) * per_step,
        "worker_idle_ms_per_step": (after.worker_idle_s - before.worker_idle_s) * per_step,
    }


def format_stats(s: dict[str, float]) -> str:
    return (
        f"engine steps {s['steps']} (prefill tok {s['prefill_tokens']}, decode tok {s['decode_tokens']}, "
        f"retractions {s['retractions']}): per step scheduler CPU {s['schedule_ms_per_step']:.3f} ms, "
        f"worker busy {s['worker_busy_ms_per_step']:.3f} ms, worker idle (bubble) "
        f"{s['worker_idle_ms_per_step']:.3f} ms"
    )
