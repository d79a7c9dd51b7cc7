"""transformers as the reference: greedy continuation with the top-2 logits at every step, memoized per
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
# bf16 keeps 8 significant bits: two runs that round differently can swap logits this far apart.
NEAR_TIE_BF16 = 0.25
# A float16 KV pool under a float32 model (--kv-cache-dtype float16): only K/V are rounded, to 11 significant
# bits, 3 more than bf16's, so errors 8x smaller: 0.25 / 8 ~ 0.03. Measured on the tiny test models (llama,
# qwen2, qwen3; prompts of 8-333 tokens), the largest logit moved 0.011-0.015 against a float32 pool, so a
# top-2 gap moves up to ~0.03; 0.05 leaves room for other prompts.
NEAR_TIE_KV_F16 = 0.05
# Set by tests/conftest.py (slow_cache_dir); unset: memoized in the process only.
CACHE_ENV = "TANDEM_TEST_REF_CACHE"


@dataclass(frozen=True)
class RefRun:
    model_dir: Path
    prompt: tuple[int, ...]
    dtype: torch.dtype
    tokens: list[int]
    gaps: list[float]  # top-1 minus top-2 logit at each generated position
    runner_ups: list[int]  # the top-2 token at each generated position


_models: dict[str, object] = {}
_runs: dict[tuple[str, str, tuple[int, ...]], RefRun] = {}
_hashes: dict[str, str] = {}
_REFERENCE_CODE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of a directory, or of a .gguf file read by transformers' own GGUF loader (its
    config mapping and dequantization: nothing of the engine's conversion)."""
    key = f"{model_dir}:{dtype}"
    if key not in _models:
        from transformers import AutoModelForCausalLM

        path = Path(model_dir)
        if path.suffix == ".gguf":
            m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
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
        files = [path] if path.suffix == ".gguf" else [*sorted(path.glob("*.safetensors")), path / "config.json"]
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


def _top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.topk(logits.float(), 2, dim=-1)
    return top.values, top.indices


@torch.inference_mode()
def _compute_greedy(model_dir: Path, prompt: tuple[int, ...], n: int, dtype: torch.dtype) -> dict:
    # Full recompute each step: slow but free of any cache API, so it is the plainest reference.
    model = hf_model(model_dir, dtype)
    seq = list(prompt)
    out: dict[str, list] = {"tokens": [], "gaps": [], "runner_ups": []}
    for _ in range(n):
        values, ids = _top2(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1])
        out["tokens"].append(int(ids[0]))
        out["gaps"].append(float(values[0] - values[1]))
        out["runner_ups"].append(int(ids[1]))
        seq.append(int(ids[0]))
    return out


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
        run = RefRun(Path(model_dir), prompt, dtype, got["tokens"], got["gaps"], got["runner_ups"])
        _runs[key] = run
    return replace(run, tokens=run.tokens[:n], gaps=run.gaps[:n], runner_ups=run.runner_ups[:n])


def assert_greedy_parity(got: list[int], ref: RefRun, what: str, near_tie: float = NEAR_TIE) -> bool:
    """As long as the reference, and equal to it, except that at a near-tie of the reference's own logits
    (top-2 gap < near_tie) the engine may take the runner-up; from there on it is held to the reference
    continued from the engine's token. Returns True if equal throughout."""
    assert len(got) == len(ref.tokens), f"{what}: {len(got)} tokens vs {len(ref.tokens)} of the reference"
    done = 0  # got[:done] is checked; ref continues from prompt + got[:done]
    while True:
        i = next((k for k, (a, b) in enumerate(zip(got[done:], ref.tokens)) if a != b), None)
        if i is None:
            return done == 0
        pos = done + i
        assert ref.gaps[i] < near_tie and got[pos] == ref.runner_ups[i], (
            f"{what}: token {pos} is {got[pos]}, the reference's {ref.tokens[i]} (runner-up {ref.runner_ups[i]}, "
            f"top-2 gap {ref.gaps[i]:.3g}): not the runner-up at a near-tie below {near_tie}"
        )
        done = pos + 1
        ref = greedy(
            ref.model_dir, ref.prompt + tuple(ref.tokens[:i]) + (got[pos],), len(got) - done, ref.dtype
        )


def assert_parity_floor(
    runs: list[tuple[list[int], RefRun, str]], max_detours: int, near_tie: float = NEAR_TIE
) -> int:
    """Each (tokens, reference, what) held by assert_greedy_parity, and at most max_detours of them off the
    reference's own path (taking a near-tie's runner-up): a count is never thrown away. Returns how many
    were equal throughout."""
    equal = sum(assert_greedy_parity(got, ref, what, near_tie) for got, ref, what in runs)
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
    assert {got[i], want[i]} == {ref.tokens[0], ref.runner_ups[0]} and ref.gaps[0] < NEAR_TIE, (
        f"{what}: token {i} is {got[i]} vs {want[i]}; the reference's top-2 there are {ref.tokens[0]}, "
        f"{ref.runner_ups[0]} with a gap of {ref.gaps[0]:.3g}: no near-tie between the two"
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
        rows: list[dict[str, list]] = [{"tokens": [], "gaps": [], "runner_ups": []} for _ in idx]
        for step in range(n):
            values, top = _top2(out.logits[:, -1])
            for r in range(len(idx)):
                rows[r]["tokens"].append(int(top[r, 0]))
                rows[r]["gaps"].append(float(values[r, 0] - values[r, 1]))
                rows[r]["runner_ups"].append(int(top[r, 1]))
            if step + 1 == n:
                break
            mask = torch.cat([mask, torch.ones(len(idx), 1, dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=top[:, :1], attention_mask=mask, position_ids=pos,
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
    return [RefRun(Path(model_dir), tuple(p), torch.float32, r["tokens"], r["gaps"], r["runner_ups"])
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

