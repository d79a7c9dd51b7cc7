"""Greedy agreement of --cpu-int8-activations with the float32 path on a GGUF model: the same prompts, greedy,
through an engine each way; how many sequences come out identical and where the others first diverge.
With --kl, instead, llama.cpp's `llama-perplexity --kl-divergence` measure over real text for each file:
KL(exact || int8) of the full next-token distributions, top-1 agreement, each path's perplexity
(benchmarks/int8_kl.py); with --kv-cache-dtype X as well, the same measure of the KV cache's element: the
exact path with X KV against it with float32 KV (llama.cpp's `-ctk X -ctv X`; a HF directory works too).

    python -m tandem.benchmarks.int8_agreement --model M.gguf [--prompts 32 --tokens 64]
    python -m tandem.benchmarks.int8_agreement --kl --model A.gguf B.gguf ... [--chunks 16 --ctx 512]
    python -m tandem.benchmarks.int8_agreement --kl --kv-cache-dtype q8_0 --model A.gguf DIR ... [--ctx 8192]

The prompts are short English instructions in the model's chat template (a base model's as plain "Q: ...
A:" text; varied topics), so the
continuations are the model's ordinary text, not noise. Then, teacher-forced on the float32 path's
continuations (each engine scores prompt + continuation with top-2 prompt logprobs), at every generated
position: how often the int8 path's top token differs, the float32 top-2 margin where it does, and the mean
difference of the float32 top token's logprob (where it left the int8 path's top 2: that path's second
logprob, a bound). One flip anywhere makes the greedy sequences part, so a
per-position rate p leaves about (1 - p) ** tokens of them identical.
"""
from __future__ import annotations

import argparse
import statistics

from tandem import Client, SamplingParams
from tandem.benchmarks import int8_kl
from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.protocol.choices import KVCacheDType, literal_values
from tandem.protocol.tokenizer_loader import load_tokenizer

TOPICS = (
    "the moon",
    "bread",
    "a bicycle",
    "rain",
    "Python lists",
    "the French revolution",
    "volcanoes",
    "chess openings",
    "photosynthesis",
    "a lighthouse",
    "coffee",
    "prime numbers",
    "the ocean",
    "trains",
    "honey bees",
    "winter",
    "a violin",
    "recursion",
    "the desert",
    "friendship",
    "clocks",
    "glaciers",
    "tea ceremonies",
    "electric cars",
    "mountains",
    "libraries",
    "the internet",
    "gardening",
    "owls",
    "sorting algorithms",
    "jazz",
    "bridges",
    "the sun",
    "paper",
    "salt",
    "rivers",
)
ASKS = ("Write two sentences about {}.", "Explain {} to a child.", "Give three facts about {}.",
        "Describe {} in a short poem.")


def prompts(model: str, n: int) -> list[list[int]]:
    tok = load_tokenizer(model)
    out = []
    for i in range(n):
        msg = ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)])
        if tok.chat_template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
            )
        else:  # a base model (Gemma 3 270M's file): the request as plain text, a question and its answer
            text = f"Q: {msg}\nA:"
        out.append(tok(text).input_ids)
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(prog="python -m tandem.benchmarks.int8_agreement", allow_abbrev=False)
    ap.add_argument("--model", required=True, nargs="+", help="a .gguf file (--kl: one or more)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kl", action="store_true", help="KL divergence and top-1 agreement over real text")
    ap.add_argument("--chunks", type=int, default=16, help="--kl: chunks of text")
    ap.add_argument("--ctx", type=int, default=512, help="--kl: tokens a chunk (its second half scored)")
    ap.add_argument("--kv-cache-dtype", choices=literal_values(KVCacheDType), default=None,
                    help="--kl: compare this KV element against float32 KV (exact products both) instead")
    args = ap.parse_args(argv)
    if args.kv_cache_dtype is not None and not args.kl:
        ap.error("--kv-cache-dtype goes with --kl")
    if args.kl:
        if args.chunks < 1 or args.ctx < 4:
            ap.error("--chunks must be at least 1 and --ctx at least 4")
        return kl_table(args.model, args.chunks, args.ctx, args.kv_cache_dtype)
    if len(args.model) != 1:
        ap.error("the greedy comparison takes one --model (--kl takes several)")
    args.model = args.model[0]
    ids = prompts(args.model, args.prompts)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    outs: dict[bool, list[list[int]]] = {}
    tops: dict[bool, list[tuple[list[int], list[float]]]] = {}  # per position: top-2 ids and logprobs
    for int8 in (False, True):
        client = Client.launch(args.model, dtype="float32", cpu_int8_activations=int8)
        try:
            outs[int8] = [c.token_ids for c in client.generate_batch(ids, params, progress=False)]
            forced = [p + c for p, c in zip(ids, outs[False])]  # the float32 path's continuations
            scored = client.generate_batch(forced, [SamplingParams(max_tokens=1, prompt_logprobs=2,
                                                                   logprob_start_len=len(p)) for p in ids],
                                           progress=False)
            tops[int8] = [(i, lp) for c in scored for i, lp in zip(c.prompt_logprobs.top_ids,
                                                                    c.prompt_logprobs.top_logprobs)]
        finally:
            client.close()
    first = [
        next((i for i, (a, b) in enumerate(zip(f, q)) if a != b), None)
        for f, q in zip(outs[False], outs[True])
    ]
    diverged = sorted(i for i in first if i is not None)
    flips = [f[1][0] - f[1][1] for f, q in zip(tops[False], tops[True]) if f[0][0] != q[0][0]]
    margins = [f[1][0] - f[1][1] for f in tops[False]]
    shift = statistics.mean(
        abs(f[1][0] - dict(zip(*q)).get(f[0][0], q[1][1])) for f, q in zip(tops[False], tops[True])
    )
    print(cpu_caps().describe())
    print(f"{args.prompts} prompts x {args.tokens} greedy tokens, float32 vs int8 activations: "
          f"{first.count(None)} identical; first divergence at token "
          + (f"{diverged} (median {statistics.median(diverged)})" if diverged else "-"))
    print(
        f"teacher-forced on the float32 continuations: the top token differs at {len(flips)} of {len(margins)} "
        f"positions (float32 top-2 margin there at most {max(flips, default=0):.3f} nats; "
        f"{sum(m < 0.1 for m in margins)} positions have one under 0.1); mean |logprob difference| of the "
        f"float32 top token {shift:.3f}"
    )
    return {"identical": first.count(None), "first_divergence": diverged, "flips": len(flips)}


def kl_table(models: list[str], chunks: int, ctx: int, kv_dtype: str | None = None) -> dict[str, object]:
    """Each file's int8 path against its exact path over the same text (kv_dtype: its exact path over KV of
    that element against over float32 KV); prints the table as it goes."""
    print(cpu_caps().describe())
    print(int8_kl.corpus_line(chunks, ctx))
    rows = []
    for m in models:
        rows.append(int8_kl.measure(m, chunks, ctx, kv_dtype=kv_dtype))
        print(f"{m}: {rows[-1]['positions']} positions, {rows[-1]['seconds']:.0f} s", flush=True)
    print(int8_kl.table(rows))
    return {r["model"]: r for r in rows}


if __name__ == "__main__":
    main()
