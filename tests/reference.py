"""transformers as the reference: greedy continuation with the top-4 logits at every step, memoized per
(model, prompt, dtype) in the process and on disk (keyed by the model files' SHA-256), and the near-tie rule
the engine's outputs are held to."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

NEAR_TIE = 1e-3
# The lower precisions' tolerances, each measured for its pair by benchmarks/bf16_logit_error.py --engine
# (benchmarks/results/reference/bf16_logit_error.md): the largest movement of the reference's top-2 gap over
# prefill, one-row and many-row decode positions, x1.25 for prompts not measured. A greedy run can take the
# runner-up only where the reference's gap is below its own error.
NEAR_TIE_BF16 = 0.16  # --dtype bfloat16 against transformers in bf16, tiny models: max 0.125
NEAR_TIE_BF16_KV = 0.13  # float32 over a bfloat16 KV pool against float32, tiny qwen3: max 0.104
NEAR_TIE_KV_F16 = 0.014  # float32 over a float16 KV pool against float32, tiny qwen3: max 0.011
# float32 over a q8_0 KV pool against float32 (over every prefill position of 8 prompts of 8-300 tokens):
# small llama max 0.227, small qwen3 0.262, tiny gemma3 0.167
NEAR_TIE_KV_Q8_0 = 0.33
# --dtype auto on an AMX / AVX512-BF16 CPU (bf16 weights under float32 activations) against float32, on
# SmolLM2-135M over its own language (--text): decode steps of at most 8 rows (the C kernel, float32
# activations) max 0.331, of more rows (torch, activations rounded to bf16) 0.436, prefill 0.426.
NEAR_TIE_BF16_WEIGHTS = 0.55
# How many of the reference's best tokens it keeps: a near-tie can be three-way.
TOP_K = 4
# Set by tests/conftest.py (slow_cache_dir); unset: memoized in the process only.
CACHE_ENV = "TANDEM_TEST_REF_CACHE"


@dataclass(frozen=True)
class RefRun:
    model_dir: Path
    prompt: tuple[int, ...]
    dtype: torch.dtype
    tokens: list[int]
    alts: list[list[int]]  # the TOP_K best tokens at each generated position, best first (tokens[i] first)
    alt_gaps: list[list[float]]  # the best logit minus each one's (0.0 first)

    @property
    def gaps(self) -> list[float]:
        """top-1 minus top-2 logit at each generated position"""
        return [g[1] for g in self.alt_gaps]

    @property
    def runner_ups(self) -> list[int]:
        return [a[1] for a in self.alts]


_models: dict[str, object] = {}
_runs: dict[tuple[str, str, tuple[int, ...]], RefRun] = {}
_hashes: dict[str, str] = {}
_REFERENCE_CODE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def gguf_own_config(gguf: Path) -> Path:
    """Where a .gguf file's own HF config may be written for the reference: <stem>.config.json beside it."""
    return gguf.with_name(f"{gguf.stem}.config.json")


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of a directory, or of a .gguf file read by transformers' own GGUF loader (its
    config mapping and dequantization: nothing of the engine's conversion). A file's own config written beside it
    (`<stem>.config.json`: see gguf_own_config) is used instead of transformers' mapping of the file's metadata, which leaves
    what it does not map (a made MoE model's expert width, Gemma 3's pattern) at its defaults."""
    key = f"{model_dir}:{dtype}"
    if key not in _models:
        from transformers import AutoModelForCausalLM

        path = Path(model_dir)
        if path.suffix == ".gguf":
            config = None
            if gguf_own_config(path).is_file():
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(str(gguf_own_config(path)))
            m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                     config=config)
        else:
            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        wrong = {p.dtype for p in m.parameters()} - {dtype}
        assert not wrong, f"the reference asked for {dtype} holds {wrong} weights"  # a bf16 run is bf16
        m.eval()
        _models[key] = m
    return _models[key]


def model_hash(model_dir: Path) -> str:
    """SHA-256 of what decides the logits (config and weights): equal files, equal reference."""
    key = str(Path(model_dir).resolve())
    if key not in _hashes:
        h = hashlib.sha256()
        path = Path(model_dir)
        if path.suffix == ".gguf":
            files = [path, *[c for c in [gguf_own_config(path)] if c.is_file()]]
        else:
            files = [*sorted(path.glob("*.safetensors")), path / "config.json"]
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
        _hashes[key] = h.hexdigest()
    return _hashes[key]


def _disk_path(model_dir: Path, kind: str, payload: object) -> Path | None:
    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    import transformers

    # another library may compute other logits, and this file's code another reference
    versions = [torch.__version__, transformers.__version__, _REFERENCE_CODE]
    key = hashlib.sha256(json.dumps([model_hash(model_dir), kind, payload, versions]).encode()).hexdigest()
    return Path(root) / key[:2] / f"{key}.json"


def _load(path: Path | None) -> object | None:
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def _store(path: Path | None, value: object) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # atomic: a concurrent run reads the old file or the new one, never half


def _add_top(rows: list[dict[str, list]], logits: torch.Tensor) -> torch.Tensor:
    """Append each row's best token, its TOP_K best and their gaps to rows; returns the best tokens."""
    top = torch.topk(logits.float(), TOP_K, dim=-1)
    for row, values, ids in zip(rows, top.values, top.indices, strict=True):
        row["tokens"].append(int(ids[0]))
        row["alts"].append(ids.tolist())
        row["alt_gaps"].append((values[0] - values).tolist())
    return top.indices[:, 0]


def _rows(n: int) -> list[dict[str, list]]:
    return [{"tokens": [], "alts": [], "alt_gaps": []} for _ in range(n)]


@torch.inference_mode()
def _compute_greedy(model_dir: Path, prompt: tuple[int, ...], n: int, dtype: torch.dtype) -> dict:
    model = hf_model(model_dir, dtype)
    rows = _rows(1)
    if dtype != torch.float32:
        # Full recompute each step, as benchmarks/bf16_logit_error.py measured bf16's tolerance against: a
        # cached step's other shapes round bf16 otherwise. Free of any cache API, the plainest reference.
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(_add_top(rows, model(input_ids=torch.tensor([seq]), use_cache=False).logits[:, -1])[0]))
        return rows[0]
    # float32: transformers' own KV cache (float32 sums differ from a full recompute's by ~1e-6, far below
    # any tolerance here), so a real model's long continuations cost one forward per token.
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    for step in range(n):
        best = _add_top(rows, out.logits[:, -1])
        if step + 1 < n:
            out = model(input_ids=best[:, None], past_key_values=out.past_key_values, use_cache=True)
    return rows[0]


def greedy(
    model_dir: Path, prompt: list[int] | tuple[int, ...], n: int, dtype: torch.dtype = torch.float32
) -> RefRun:
    """The reference's first n tokens. A longer run already made serves a shorter one: each step sees
    only the prompt and the tokens before it."""
    prompt = tuple(prompt)
    key = (str(Path(model_dir).resolve()), str(dtype), prompt)
    run = _runs.get(key)
    if run is None or len(run.tokens) < n:
        path = _disk_path(model_dir, f"greedy:{dtype}", list(prompt))
        got = _load(path)
        if not isinstance(got, dict) or len(got["tokens"]) < n:
            got = _compute_greedy(model_dir, prompt, n, dtype)
            _store(path, got)
        run = RefRun(Path(model_dir), prompt, dtype, got["tokens"], got["alts"], got["alt_gaps"])
        _runs[key] = run
    return replace(run, tokens=run.tokens[:n], alts=run.alts[:n], alt_gaps=run.alt_gaps[:n])


def assert_greedy_parity(got: list[int], ref: RefRun, what: str, near_tie: float = NEAR_TIE,
                         max_detours: int = 1) -> bool:
    """As long as the reference, and equal to it, except that at a near-tie of the reference's own logits
    the engine may take another of the near-tied tokens (one of the reference's TOP_K whose logit is within
    near_tie of the best), at most max_detours times per sequence; from there on it is held to the reference
    continued from the engine's token. Returns True if equal throughout."""
    assert len(got) == len(ref.tokens), f"{what}: {len(got)} tokens vs {len(ref.tokens)} of the reference"
    done = 0  # got[:done] is checked; ref continues from prompt + got[:done]
    detours = 0
    while True:
        i = next((k for k, (a, b) in enumerate(zip(got[done:], ref.tokens)) if a != b), None)
        if i is None:
            return done == 0
        pos = done + i
        tied = {t for t, g in zip(ref.alts[i], ref.alt_gaps[i], strict=True) if g < near_tie}
        assert got[pos] in tied, (
            f"{what}: token {pos} is {got[pos]}, the reference's {ref.tokens[i]} (its best {ref.alts[i]} "
            f"below the top by {[round(g, 4) for g in ref.alt_gaps[i]]}): not within a near-tie of {near_tie}"
        )
        detours += 1
        assert detours <= max_detours, (
            f"{what}: a near-tie detour at token {pos} is its {detours}th (at most {max_detours} per sequence)"
        )
        done = pos + 1
        ref = greedy(
            ref.model_dir, ref.prompt + tuple(ref.tokens[:i]) + (got[pos],), len(got) - done, ref.dtype
        )


def assert_parity_floor(
    runs: list[tuple[list[int], RefRun, str]], max_detours: int, near_tie: float = NEAR_TIE,
    per_sequence: int = 1,
) -> int:
    """Each (tokens, reference, what) held by assert_greedy_parity with at most per_sequence detours, and at
    most max_detours of them off the reference's own path (through a near-tie): a count is never thrown
    away. Returns how many were equal throughout."""
    equal = sum(assert_greedy_parity(got, ref, what, near_tie, per_sequence) for got, ref, what in runs)
    assert len(runs) - equal <= max_detours, (
        f"{len(runs) - equal} of {len(runs)} sequences took a near-tie detour (at most {max_detours}): "
        f"{runs[0][2]} ..."
    )
    return equal


def assert_equal_or_near_tie(model_dir: Path, prompt: list[int], got: list[int], want: list[int],
                             what: str = "output") -> None:
    """Two engine runs that should agree (different batch shapes, schedules, ranks): equal, or parted where
    the reference sees a near-tie between exactly their two tokens, and `got` held to the reference after."""
    assert len(got) == len(want), f"{what}: {len(got)} tokens vs {len(want)}"
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return
    ref = greedy(model_dir, list(prompt) + want[:i], len(got) - i)
    tied = {t for t, g in zip(ref.alts[0], ref.alt_gaps[0], strict=True) if g < NEAR_TIE}
    assert {got[i], want[i]} <= tied, (
        f"{what}: token {i} is {got[i]} vs {want[i]}; the reference's best there are {ref.alts[0]}, below the "
        f"top by {[round(g, 4) for g in ref.alt_gaps[0]]}: no near-tie between the two"
    )
    assert_greedy_parity(got[i:], ref, f"{what} after its near-tie at token {i}")


@torch.inference_mode()
def _compute_batched(model_dir: Path, prompts: list[list[int]], n: int, batch_size: int) -> list[dict]:
    model = hf_model(model_dir)
    runs: dict[int, dict] = {}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # Only the last position's logits: [batch, 600, 49k] floats would be most of the cost.
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        rows = _rows(len(idx))
        for step in range(n):
            best = _add_top(rows, out.logits[:, -1])
            if step + 1 == n:
                break
            mask = torch.cat([mask, torch.ones(len(idx), 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=best[:, None], attention_mask=mask, position_ids=pos,
                        past_key_values=out.past_key_values, use_cache=True)
        for r, i in enumerate(idx):
            runs[i] = rows[r]
    return [runs[i] for i in range(len(prompts))]


def greedy_batched(model_dir: Path, prompts: list[list[int]], n: int, batch_size: int = 8) -> list[RefRun]:
    """greedy() for many prompts at once, with transformers' KV cache: similar lengths batched together,
    left-padded, positions counted from each prompt's first real token."""
    path = _disk_path(model_dir, f"batched:{batch_size}:{n}", prompts)
    got = _load(path)
    if not isinstance(got, list):
        got = _compute_batched(model_dir, prompts, n, batch_size)
        _store(path, got)
    return [RefRun(Path(model_dir), tuple(p), torch.float32, r["tokens"], r["alts"], r["alt_gaps"])
            for p, r in zip(prompts, got)]


def gguf_config_differences(gguf: Path) -> dict[str, tuple[object, object]]:
    """The fields of the ModelConfig the engine runs where its reading of a GGUF file's metadata
    (protocol/gguf_metadata.py) and transformers' own GGUF config mapping disagree: {field: (ours,
    theirs)}. Floats compare as the file's float32 (the engine prints them back to 7 digits)."""
    import dataclasses

    import numpy as np
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tandem.protocol.model_config import ModelConfig, read_model_config

    theirs = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    theirs["architectures"] = theirs.get("architectures") or [
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[theirs["model_type"]]
    ]
    a, b = read_model_config(gguf), ModelConfig.from_hf(theirs)

    def same(x: object, y: object) -> bool:
        if isinstance(x, float) and isinstance(y, float):
            return bool(np.float32(x) == np.float32(y))
        if isinstance(x, tuple) and isinstance(y, tuple) and not (x and y):  # layer_types: () is all full
            return set(x + y) <= {"full_attention"}
        return x == y

    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(ModelConfig)
            if not same(getattr(a, f.name), getattr(b, f.name))}

