"""How far bf16 moves a model's logits from float32: the measurement a bf16 near-tie tolerance should come
from (tests/reference.py's NEAR_TIE_BF16). transformers runs the model three ways over the same token
sequences (random prompts, each followed by its float32 greedy continuation, so every position is one a
greedy run reaches): float32; bf16 weights under float32 activations (what `--dtype auto` keeps on a CPU with
AMX or AVX512-BF16); all bf16 (`--dtype bfloat16`). At each position it takes float32's top two tokens and
reports how much the gap between them moved, |gap_variant - gap_f32|, as percentiles: a greedy run can take
the runner-up only where float32's gap is below that movement.

    python -m tandem.benchmarks.bf16_logit_error --model DIR_OR_GGUF [--prompts 16] [--tokens 48]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch


def _load(model: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    p = Path(model)
    if p.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype).eval()


@torch.inference_mode()
def gap_movements(model: str, prompts: int, tokens: int, seed: int) -> dict[str, list[float]]:
    f32 = _load(model, torch.float32)
    vocab = f32.config.vocab_size
    rng = random.Random(seed)
    seqs = []
    for _ in range(prompts):  # each prompt then its float32 greedy continuation
        ids = torch.tensor([[rng.randrange(3, min(vocab, 30000)) for _ in range(rng.randint(8, 96))]])
        out = f32.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        seqs.append(out)
    bf16_weights = _load(model, torch.float32)
    for p in bf16_weights.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    variants = {"bf16 weights, f32 activations": bf16_weights, "all bf16": _load(model, torch.bfloat16)}
    moved: dict[str, list[float]] = {name: [] for name in variants}
    for seq in seqs:
        ref = f32(seq).logits[0].float()
        top = torch.topk(ref, 2, dim=-1)
        gap = top.values[:, 0] - top.values[:, 1]
        for name, m in variants.items():
            logits = m(seq).logits[0].float()
            other = logits.gather(1, top.indices)
            moved[name] += (other[:, 0] - other[:, 1] - gap).abs().tolist()
    return moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    moved = gap_movements(args.model, args.prompts, args.tokens, args.seed)
    print(f"{args.model}: top-2 gap movement against float32 over {len(next(iter(moved.values())))} positions")
    for name, xs in moved.items():
        t = torch.tensor(xs)
        qs = [float(torch.quantile(t, q)) for q in (0.5, 0.99, 0.999)]
        print(f"  {name}: median {qs[0]:.4f}, p99 {qs[1]:.4f}, p99.9 {qs[2]:.4f}, max {float(t.max()):.4f}")


if __name__ == "__main__":
    main()
