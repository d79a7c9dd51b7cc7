"""What int8 activations cost in accuracy, measured as llama.cpp's `llama-perplexity --kl-divergence` does:
the same token sequences of real text through a GGUF file's exact float32-activation path and its int8 path,
full-vocabulary log-probabilities of both at every scored position; per file the mean KL(exact || int8)
with its spread, how often the argmax agrees, and each path's perplexity on the text.

The text is the Python Language Reference as the interpreter ships it (`pydoc_data.topics`: its topics in
name order), so it is real English prose (with some grammar blocks), needs no download and is the same for a
given Python version (its SHA-256 is printed). As llama.cpp does, it is tokenized whole, cut into chunks of
`ctx` tokens (the first token of each replaced by BOS where the tokenizer adds one), and only the second half
of each chunk is scored: positions ctx/2 .. ctx-2, each predicting the next token, so every scored position
sees at least ctx/2 tokens of context.

Both paths are the worker's own model (worker/loader.py, the ops ModelRunner resolves for a float32 CPU
worker with and without int8 activations) run over a prompt as a prefill step runs it; the logits are the
LM head's for the scored positions only.
"""
from __future__ import annotations

import hashlib
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.kernels.ops import resolve_ops
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.gguf_tensor_index import gguf_tensor_index
from tandem.protocol.tokenizer_loader import load_tokenizer
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.loader import load_model


def corpus() -> str:
    """The Python Language Reference's topics as the running interpreter ships them, in name order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def text_chunks(tokenizer: Any, text: str, n_chunks: int, ctx: int) -> list[list[int]]:
    """The text's first n_chunks chunks of ctx tokens, each starting with BOS where the tokenizer adds one
    (llama.cpp's perplexity overwrites each chunk's first token so)."""
    need = n_chunks * ctx
    # A prefix of ~3x the characters the tokens need is enough (a whole Gemma-vocabulary pass takes seconds);
    # the margin keeps the cut's last, possibly split, word out of the chunks.
    for cut in (need * 12, len(text)):
        ids = tokenizer(text[:cut], add_special_tokens=False).input_ids
        if len(ids) >= need + 64:
            break
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than {n_chunks} chunks of {ctx}")
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [bos]
    chunks = [ids[i * ctx : (i + 1) * ctx] for i in range(n_chunks)]
    if adds_bos:
        for c in chunks:
            c[0] = bos
    return chunks


class LogitPath:
    """One GGUF file's model on one path (exact or int8 products) with a KV pool for one ctx-token chunk."""

    def __init__(self, model: str, int8: bool, ctx: int) -> None:
        # The ops a float32 CPU worker resolves (worker/model_runner.py) for the explicit choice.
        self.ops = resolve_ops("cpu", torch.float32, EngineConfig(model=model).attention_backend, int8)
        if self.ops.int8_activations != int8:
            raise RuntimeError("int8 activations need the C kernels (a C compiler, CPU, float32)")
        self.model = load_model(model, torch.float32, "cpu", ops=self.ops)
        self.model.pack_cpu_weights(torch.float32)
        mc = self.model.config
        # Slot 0 is the engine's padding slot: the chunk's tokens take slots 1..ctx, row 0.
        self.kv = KVCache(mc.num_hidden_layers, ctx + 1, mc.num_key_value_heads, mc.head_dim, torch.float32,
                          "cpu", max_reqs=1, max_context=ctx)
        self.kv.req_to_token[0, :ctx] = torch.arange(1, ctx + 1)

    @torch.inference_mode()
    def logprobs(self, ids: Sequence[int], first: int) -> torch.Tensor:
        """log-softmax of the logits at positions first .. len(ids)-2 of one prefill of ids: [n, vocab]."""
        n = len(ids)
        batch = ForwardBatch.from_lists(ids, range(1, n + 1), [0], [n], [n], range(first, n - 1))
        return torch.log_softmax(self.model.forward(batch, self.kv).float(), dim=-1)


@dataclass
class Scores:
    """Per scored position: KL(exact || int8), whether the argmaxes agree, each path's -log p(next token),
    and p(next token) on each path."""

    kl: list[float]
    same_top: list[bool]
    nll: tuple[list[float], list[float]]
    p: tuple[list[float], list[float]]

    def add(self, exact: torch.Tensor, int8: torch.Tensor, targets: torch.Tensor) -> None:
        self.kl += (exact.exp() * (exact - int8)).sum(-1).tolist()
        self.same_top += (exact.argmax(-1) == int8.argmax(-1)).tolist()
        for i, lp in enumerate((exact, int8)):
            t = lp.gather(1, targets[:, None])[:, 0]
            self.nll[i].extend((-t).tolist())
            self.p[i].extend(t.exp().tolist())

    def summary(self) -> dict[str, float]:
        n = len(self.kl)
        kl = sorted(self.kl)
        mean_nll = [statistics.fmean(x) for x in self.nll]
        dp = [b - a for a, b in zip(*self.p, strict=True)]
        return {
            "positions": n,
            "ppl_exact": math.exp(mean_nll[0]),
            "ppl_int8": math.exp(mean_nll[1]),
            "ln_ppl_ratio": mean_nll[1] - mean_nll[0],  # ln(PPL(int8) / PPL(exact))
            "kl_mean": statistics.fmean(kl),
            "kl_stderr": statistics.stdev(kl) / math.sqrt(n) if n > 1 else 0.0,
            "kl_median": kl[n // 2],
            "kl_p99": kl[min(n - 1, math.ceil(0.99 * n) - 1)],
            "kl_max": kl[-1],
            "same_top_pct": 100.0 * sum(self.same_top) / n,
            "rms_dp_pct": 100.0 * math.sqrt(statistics.fmean(d * d for d in dp)),  # llama.cpp's RMS Δp
        }


def matrix_types(model: str) -> str:
    """The file's 2-D tensors by type, most first (llama-quantize falls back where a row's length does not
    fit a type's block, so a K-quant file's name does not say all of it)."""
    types = Counter(t.type_name for t in gguf_tensor_index(model).tensors if len(t.shape) == 2)
    return " ".join(f"{k}x{v}" for k, v in types.most_common())


def measure(model: str, n_chunks: int, ctx: int, paths: tuple[bool, bool] = (False, True)) -> dict[str, Any]:
    """Score one file; paths: the (reference, candidate) int8 choices, exact against int8 by default (a test
    passes one path twice)."""
    t0 = time.perf_counter()
    chunks = text_chunks(load_tokenizer(model), corpus(), n_chunks, ctx)
    ref, cand = LogitPath(model, paths[0], ctx), LogitPath(model, paths[1], ctx)
    first = ctx // 2
    scores = Scores([], [], ([], []), ([], []))
    for ids in chunks:
        targets = torch.tensor(ids[first + 1 :])
        scores.add(ref.logprobs(ids, first), cand.logprobs(ids, first), targets)
    out: dict[str, Any] = scores.summary()
    out.update(model=model, types=matrix_types(model), seconds=time.perf_counter() - t0)
    return out


def corpus_line(n_chunks: int, ctx: int) -> str:
    """What text was scored, and how (its hash: the topics change between Python versions)."""
    text = corpus()
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return (f"text: the Python {sys.version.split()[0]} Language Reference (pydoc_data.topics, {len(text)} chars, "
            f"sha256 {digest}); {n_chunks} chunks x {ctx} tokens, the last {ctx - 1 - ctx // 2} of each scored")


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, one file a row."""
    head = ("| file | matrices | PPL exact | PPL int8 | ln(PPL int8/exact) | mean KL | 99% KL | max KL | "
            "same top | RMS Δp |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {Path(r['model']).name} | {r['types']} | {r['ppl_exact']:.3f} | {r['ppl_int8']:.3f} | "
            f"{r['ln_ppl_ratio']:+.5f} | {r['kl_mean']:.5f} ± {r['kl_stderr']:.5f} | {r['kl_p99']:.4f} | "
            f"{r['kl_max']:.4f} | {r['same_top_pct']:.2f}% | {r['rms_dp_pct']:.3f}% |"
        )
    return "\n".join(lines)
