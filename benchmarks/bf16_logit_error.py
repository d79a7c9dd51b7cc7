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


def _engine_gaps(lp, rows: torch.Tensor) -> list[float]:
    """The engine's gap between float32's top two tokens at each position of a Logprobs run (rows: those
    two tokens per position); inf where either is outside the engine's reported top-K."""
    out = []
    for (a, b), ids, lps in zip(rows.tolist(), lp.top_ids, lp.top_logprobs, strict=False):
        got = dict(zip(ids, lps, strict=True))
        out.append(got[a] - got[b] if a in got and b in got else float("inf"))
    return out


def _prompts(model: str, vocab: int, n: int, seed: int, text: bool) -> list[list[int]]:
    """n prompts of 8 to 96 tokens: random ids, or (text) slices of the built-in corpus in the model's own
    tokenizer, every third one in its chat template: a real model's logits on its own language."""
    rng = random.Random(seed)
    if not text:
        return [[rng.randrange(3, min(vocab, 30000)) for _ in range(rng.randint(8, 96))] for _ in range(n)]
    from tandem.launch.tokenizer_maker import CORPUS_PATH
    from tandem.protocol.tokenizer_loader import load_tokenizer

    p = Path(model)
    tok = load_tokenizer(p.parent if p.suffix == ".gguf" else p)
    corpus = tok(CORPUS_PATH.read_text(encoding="utf-8")).input_ids
    out = []
    for i in range(n):
        start, length = rng.randrange(len(corpus) - 100), rng.randint(8, 96)
        piece = corpus[start : start + length]
        if i % 3 == 2:
            piece = tok.apply_chat_template([{"role": "user", "content": tok.decode(piece)}],
                                            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        out.append(piece)
    return out


@torch.inference_mode()
def engine_movements(model: str, prompts: int, tokens: int, seed: int, dtype: str,
                     against: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                     text: bool = False) -> dict[str, list[float]]:
    """The engine itself (launched with --dtype `dtype` and --kv-cache-dtype `kv_cache_dtype`) against transformers in `against`: the gap
    movement at every prefill position (prompt_logprobs over the whole sequence: one forward of many rows),
    and at every decode position of the engine's own greedy continuation with logprobs, up to and including
    where it first parts from the reference's path (after which the positions differ), decoded one request
    at a time (one-row products) and all together (as many rows as prompts)."""
    from tandem import Client
    from tandem.protocol.sampling_params import SamplingParams

    ref_model = _load(model, against)
    seqs, tops, gaps = [], [], []
    for head in _prompts(model, ref_model.config.vocab_size, prompts, seed, text):
        ids = torch.tensor([head])
        seq = ref_model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        top = torch.topk(ref_model(seq).logits[0].float(), 2, dim=-1)
        seqs.append(seq[0].tolist())
        tops.append(top.indices)
        gaps.append((top.values[:, 0] - top.values[:, 1]).tolist())
    moved: dict[str, list[float]] = {"prefill": [], "decode, 1 row": [], f"decode, {prompts} rows": []}
    decode = SamplingParams(max_tokens=tokens, logprobs=8, temperature=0.0, ignore_eos=True)
    with Client.launch(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=16384) as client:
        heads = [seq[: len(seq) - tokens] for seq in seqs]
        runs = {"decode, 1 row": [client.generate(h, decode) for h in heads],
                f"decode, {prompts} rows": client.generate_batch(heads, decode, progress=False)}
        for i, (seq, top, gap) in enumerate(zip(seqs, tops, gaps, strict=True)):
            pre = client.generate(seq, SamplingParams(max_tokens=1, prompt_logprobs=8, temperature=0.0))
            got = _engine_gaps(pre.prompt_logprobs, top[:-1])  # rows 0.. predict tokens 1..
            moved["prefill"] += [abs(g - r) for g, r in zip(got, gap, strict=False)]
            n = len(heads[i])
            for name, outs in runs.items():
                out = outs[i]
                same = next((k for k, (a, b) in enumerate(zip(out.token_ids, seq[n:], strict=True)) if a != b),
                            tokens - 1)
                got = _engine_gaps(out.logprobs, top[n - 1 : n - 1 + tokens])
                # position 0 is the prompt's own prefill; the decode steps are the ones after it
                moved[name] += [abs(g - r) for g, r in zip(got[1 : same + 1], gap[n : n + same], strict=True)]
    return moved


def _report(title: str, moved: dict[str, list[float]]) -> None:
    print(title)
    for name, xs in moved.items():
        t = torch.tensor(xs)
        if not len(t):
            print(f"  {name}: no positions")
            continue
        qs = [float(torch.quantile(t[t.isfinite()], q)) for q in (0.5, 0.99, 0.999)]
        print(f"  {name} ({len(t)} positions): median {qs[0]:.4f}, p99 {qs[1]:.4f}, p99.9 {qs[2]:.4f}, "
              f"max {float(t.max()):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=["auto", "bfloat16", "float32"], default=None,
                    help="measure the engine launched with this --dtype instead of transformers' variants")
    ap.add_argument("--against", choices=["float32", "bfloat16"], default="float32",
                    help="with --engine: the transformers dtype it is compared with")
    ap.add_argument("--kv-cache-dtype", default="auto", help="with --engine: its KV pool's dtype")
    ap.add_argument("--text", action="store_true",
                    help="with --engine: prompts from the built-in corpus in the model's tokenizer, not random ids")
    args = ap.parse_args()
    if args.engine:
        against = getattr(torch, args.against)
        moved = engine_movements(args.model, args.prompts, args.tokens, args.seed, args.engine, against,
                                 args.kv_cache_dtype, args.text)
        _report(f"{args.model}: engine --dtype {args.engine} --kv-cache-dtype {args.kv_cache_dtype} against "
                f"transformers {args.against}", moved)
        return
    moved = gap_movements(args.model, args.prompts, args.tokens, args.seed)
    _report(f"{args.model}: top-2 gap movement against float32 (transformers only)", moved)


if __name__ == "__main__":
    main()
