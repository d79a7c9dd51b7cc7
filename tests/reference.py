"""transformers as the reference: greedy continuation with the top-2 logit gap at every step."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

NEAR_TIE = 1e-3
# bf16 keeps 8 significant bits: two runs that round differently can swap logits this far apart.
NEAR_TIE_BF16 = 0.25


@dataclass
class RefRun:
    tokens: list[int]
    gaps: list[float]  # top-1 minus top-2 logit at each generated position


_cache: dict[str, object] = {}


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    key = f"{model_dir}:{dtype}"
    if key not in _cache:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype)
        m.eval()
        _cache[key] = m
    return _cache[key]


@torch.inference_mode()
def greedy(model_dir: Path, prompt: list[int], n: int, dtype: torch.dtype = torch.float32) -> RefRun:
    # Full recompute each step: slow but free of any cache API, so it is the plainest reference.
    model = hf_model(model_dir, dtype)
    seq = list(prompt)
    tokens: list[int] = []
    gaps: list[float] = []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        top = torch.topk(logits, 2)
        gaps.append(float(top.values[0] - top.values[1]))
        t = int(torch.argmax(logits))
        tokens.append(t)
        seq.append(t)
    return RefRun(tokens, gaps)


def assert_greedy_parity(got: list[int], ref: RefRun, what: str, near_tie: float = NEAR_TIE) -> bool:
    """Equal, or first different at a near-tie of the reference's own logits. Returns True if equal."""
    n = min(len(got), len(ref.tokens))
    for i in range(n):
        if got[i] != ref.tokens[i]:
            assert ref.gaps[i] < near_tie, (
                f"{what}: token {i} differs ({got[i]} vs transformers {ref.tokens[i]}) and the reference's "
                f"top-2 gap there is {ref.gaps[i]:.3g}, not a near-tie"
            )
            return False
    assert len(got) == len(ref.tokens), f"{what}: {len(got)} tokens vs {len(ref.tokens)}"
    return True


@torch.inference_mode()
def greedy_batched(model_dir: Path, prompts: list[list[int]], n: int, batch_size: int = 8) -> list[RefRun]:
    """greedy() for many prompts at once, with transformers' KV cache: similar lengths batched together,
    left-padded, positions counted from each prompt's first real token."""
    model = hf_model(model_dir)
    runs: dict[int, RefRun] = {}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # Only the last position's logits: [batch, 600, 49k] floats would be most of the cost.
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        toks: list[list[int]] = [[] for _ in idx]
        gaps: list[list[float]] = [[] for _ in idx]
        for step in range(n):
            logits = out.logits[:, -1].float()
            top = torch.topk(logits, 2).values
            nxt = logits.argmax(-1)
            for r in range(len(idx)):
                toks[r].append(int(nxt[r]))
                gaps[r].append(float(top[r, 0] - top[r, 1]))
            if step + 1 == n:
                break
            mask = torch.cat([mask, torch.ones(len(idx), 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                        past_key_values=out.past_key_values, use_cache=True)
        for r, i in enumerate(idx):
            runs[i] = RefRun(toks[r], gaps[r])
    return [runs[i] for i in range(len(prompts))]
