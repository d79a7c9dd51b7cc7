"""What int8 activations (or a KV cache element, below) cost in accuracy, measured as llama.cpp's
`llama-perplexity --kl-divergence` does: the same token sequences of real text through a GGUF file's exact
float32-activation path and its int8 path, full-vocabulary log-probabilities of both at every scored
position; per file the mean KL(exact || int8) with its spread, how often the argmax agrees, and each path's
perplexity on the text.

The text is the Python Language Reference as the interpreter ships it (`pydoc_data.topics`: its topics in
name order), so it is real English prose (with some grammar blocks), needs no download and is the same for a
given Python version (its SHA-256 is printed). As llama.cpp does, it is tokenized whole, cut into chunks of
`ctx` tokens (the first token of each replaced by BOS where the tokenizer adds one), and only the second half
of each chunk is scored: positions ctx/2 .. ctx-2, each predicting the next token, so every scored position
sees at least ctx/2 tokens of context.

Both paths are the worker's own model (worker/loader.py, the ops ModelRunner resolves for a float32 CPU
worker with and without int8 activations) run over a prompt as a prefill step runs it; the logits are the
LM head's for the scored positions only, LOGIT_ROWS at a time (a 262k vocabulary's 4k scored rows would be
4 GB a path).

With a KV element (`kv_dtype`: --kv-cache-dtype's float16, bfloat16, q8_0, ...) the comparison is of the
KV cache instead: one load of the model on the exact path, its chunks prefilled into a float32 pool and
into a pool of that element (llama.cpp's `-ctk X -ctv X`). Each chunk's K/V are written to the pool as the
engine writes them (KVCache.write: q8_0 blocks by the C store) and attended there by the engine's CPU
backend, the C kernel (worker/attention_backend.py's `cpu`): it reads every key, those written in the same
prefill step included, from the pool, as it does for decode rows, so a prefill of 8k tokens attends through
the very code a decode step does. (The `torch` backend, where the C kernels do not build, attends a fresh
prefill's K/V rounded as stored but with SDPA, not the engine's CPU kernel: the KV measure refuses it.)
"""
from __future__ import annotations

import copy
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
from safetensors import safe_open

from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.kv_quant import dtype_name
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.gguf_metadata import is_gguf
from tandem.protocol.gguf_tensor_index import gguf_tensor_index
from tandem.protocol.tokenizer_loader import load_tokenizer
from tandem.worker.device import resolve_kv_dtype
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.loader import load_model, safetensors_files

# Scored positions whose logits exist at once: 128 x Gemma 3's 262,144 vocabulary is 134 MB a tensor.
LOGIT_ROWS = 128


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
    """One model on one path (exact or int8 products) with a float32 KV pool for one ctx-token chunk (with_kv:
    one of another element)."""

    def __init__(self, model: str, int8: bool, ctx: int) -> None:
        # The ops a float32 CPU worker resolves (worker/model_runner.py) for the explicit choice.
        self.ops = resolve_ops("cpu", torch.float32, EngineConfig(model=model).attention_backend, int8)
        if self.ops.int8_activations != int8:
            raise RuntimeError("int8 activations need the C kernels (a C compiler, CPU, float32)")
        self.model = load_model(model, torch.float32, "cpu", ops=self.ops)
        self.model.pack_cpu_weights(torch.float32)
        limit = self.model.config.max_position_embeddings
        if ctx > limit:
            raise ValueError(f"--ctx {ctx} is past the model's context length, {limit}")
        self.ctx = ctx
        self.kv = self._pool(torch.float32)

    def _pool(self, dtype: torch.dtype) -> KVCache:
        mc = self.model.config
        # Slot 0 is the engine's padding slot: the chunk's tokens take slots 1..ctx, row 0. One pool for all
        # layers, sliding ones too (they attend their window of it, as with no pool of their own).
        kv = KVCache(mc.num_hidden_layers, self.ctx + 1, mc.num_key_value_heads, mc.head_dim, dtype, "cpu",
                     max_reqs=1, max_context=self.ctx)
        kv.req_to_token[0, : self.ctx] = torch.arange(1, self.ctx + 1)
        return kv

    def with_kv(self, dtype: torch.dtype) -> LogitPath:
        """This path's model (shared, not loaded again) over a pool of another element, attended as the
        engine attends it on CPU: by the C kernel, which reads every key from the pool."""
        if self.ops.attention != "cpu" or not self.ops.native:
            raise RuntimeError("the KV comparison needs the engine's CPU attention, the C kernel (`cpu` "
                               "backend, a C compiler)")
        other = copy.copy(self)
        other.kv = self._pool(dtype)
        return other

    @torch.inference_mode()
    def hidden(self, ids: Sequence[int], first: int) -> torch.Tensor:
        """One prefill of ids (its K/V written to this path's pool, attended from it): the final-normed
        hidden states at positions first .. len(ids)-2, [n, hidden]."""
        n = len(ids)
        batch = ForwardBatch.from_lists(ids, range(1, n + 1), [0], [n], [n], range(first, n - 1))
        return self.model.hidden_states(batch, self.kv)

    @torch.inference_mode()
    def logprobs_of(self, h: torch.Tensor) -> torch.Tensor:
        """log-softmax of the LM head's logits of hidden states h: [n, vocab]."""
        return torch.log_softmax(self.model.compute_logits(h).float(), dim=-1)

    def logprobs(self, ids: Sequence[int], first: int) -> torch.Tensor:
        """log-softmax of the logits at positions first .. len(ids)-2 of one prefill of ids: [n, vocab]."""
        return self.logprobs_of(self.hidden(ids, first))


@dataclass
class Scores:
    """Per scored position: KL(reference || candidate) (exact || int8, or float32 KV || KV of another
    element), whether the argmaxes agree, each path's -log p(next token), and p(next token) on each path."""

    kl: list[float]
    same_top: list[bool]
    nll: tuple[list[float], list[float]]
    p: tuple[list[float], list[float]]

    def add(self, ref: torch.Tensor, cand: torch.Tensor, targets: torch.Tensor) -> None:
        self.kl += (ref.exp() * (ref - cand)).sum(-1).tolist()
        self.same_top += (ref.argmax(-1) == cand.argmax(-1)).tolist()
        for i, lp in enumerate((ref, cand)):
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
            "ppl_ref": math.exp(mean_nll[0]),
            "ppl_cand": math.exp(mean_nll[1]),
            "ln_ppl_ratio": mean_nll[1] - mean_nll[0],  # ln(PPL(cand) / PPL(ref))
            "kl_mean": statistics.fmean(kl),
            "kl_stderr": statistics.stdev(kl) / math.sqrt(n) if n > 1 else 0.0,
            "kl_median": kl[n // 2],
            "kl_p99": kl[min(n - 1, math.ceil(0.99 * n) - 1)],
            "kl_max": kl[-1],
            "same_top_pct": 100.0 * sum(self.same_top) / n,
            "rms_dp_pct": 100.0 * math.sqrt(statistics.fmean(d * d for d in dp)),  # llama.cpp's RMS Δp
        }


def matrix_types(model: str) -> str:
    """The model's 2-D tensors by type, most first (llama-quantize falls back where a row's length does not
    fit a type's block, so a K-quant file's name does not say all of it); a HF directory's by dtype."""
    if is_gguf(model):
        types = Counter(t.type_name for t in gguf_tensor_index(model).tensors if len(t.shape) == 2)
    else:
        types: Counter[str] = Counter()
        for path in safetensors_files(model):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # safe_open is not a dict
                    sl = f.get_slice(name)
                    if len(sl.get_shape()) == 2:
                        types[sl.get_dtype()] += 1
    return " ".join(f"{k}x{v}" for k, v in types.most_common())


def comparison(kv_dtype: str | None) -> tuple[str, str]:
    """(reference, candidate) as the table names them: exact and int8 products, or float32 KV and KV of
    --kv-cache-dtype's element (`auto` named as it resolves under float32 activations)."""
    if kv_dtype is None:
        return "exact", "int8"
    return "float32 KV", f"{dtype_name(resolve_kv_dtype(kv_dtype, torch.float32, torch.device('cpu')))} KV"


def measure(model: str, n_chunks: int, ctx: int, paths: tuple[bool, bool] = (False, True),
            kv_dtype: str | None = None) -> dict[str, Any]:
    """Score one model (a GGUF file or a HF directory); paths: the (reference, candidate) int8 choices,
    exact against int8 by default (a test passes one path twice); kv_dtype (--kv-cache-dtype's name): the
    exact path over a float32 KV pool against the same loaded model over a pool of that element instead
    (paths ignored)."""
    t0 = time.perf_counter()
    chunks = text_chunks(load_tokenizer(model), corpus(), n_chunks, ctx)
    if kv_dtype is None:
        ref, cand = LogitPath(model, paths[0], ctx), LogitPath(model, paths[1], ctx)
    else:
        ref = LogitPath(model, False, ctx)
        cand = ref.with_kv(resolve_kv_dtype(kv_dtype, torch.float32, torch.device("cpu")))
    first = ctx // 2
    scores = Scores([], [], ([], []), ([], []))
    for ids in chunks:
        targets = torch.tensor(ids[first + 1 :])
        h_ref, h_cand = ref.hidden(ids, first), cand.hidden(ids, first)
        for i in range(0, len(targets), LOGIT_ROWS):
            rows = slice(i, i + LOGIT_ROWS)
            scores.add(ref.logprobs_of(h_ref[rows]), cand.logprobs_of(h_cand[rows]), targets[rows])
    out: dict[str, Any] = scores.summary()
    out.update(model=model, types=matrix_types(model), compare=comparison(kv_dtype),
               seconds=time.perf_counter() - t0)
    return out


def corpus_line(n_chunks: int, ctx: int) -> str:
    """What text was scored, and how (its hash: the topics change between Python versions)."""
    text = corpus()
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return (f"text: the Python {sys.version.split()[0]} Language Reference (pydoc_data.topics, {len(text)} chars, "
            f"sha256 {digest}); {n_chunks} chunks x {ctx} tokens, the last {ctx - 1 - ctx // 2} of each scored")


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, one model a row, all of one comparison (its header line names it)."""
    ref, cand = rows[0]["compare"]
    head = (f"| file: {cand} vs {ref} | matrices | PPL {ref} | PPL {cand} | ln(PPL {cand}/{ref}) | mean KL | "
            "99% KL | max KL | same top | RMS Δp |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {Path(r['model']).name} | {r['types']} | {r['ppl_ref']:.3f} | {r['ppl_cand']:.3f} | "
            f"{r['ln_ppl_ratio']:+.5f} | {r['kl_mean']:.5f} ± {r['kl_stderr']:.5f} | {r['kl_p99']:.4f} | "
            f"{r['kl_max']:.4f} | {r['same_top_pct']:.2f}% | {r['rms_dp_pct']:.3f}% |"
        )
    return "\n".join(lines)
