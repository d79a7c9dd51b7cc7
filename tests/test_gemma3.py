"""Gemma 3 through the whole stack on seeded random models (launch/make_model.py, `tiny`: window 16, a global
layer every third, one KV head, soft-capped logits, linear RoPE scaling on the global layers): greedy tokens
equal transformers' for prompts far past the window, tied and untied, async and not, chunked prefill, pages of
4, prefix-cache hits, with the sliding layers' own pool (which keeps one window per cached request) and
without, TP=2 with its one KV head replicated; its GGUF file is its directory's model; `tandem serve` takes
its
chat template; a config with an unknown rope_type or a bad sliding-window pattern is one line from serve."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import SamplingParams
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_info import read_model_info
from tests.conftest import check_idle_engine
from tests.gguf_files import write_gguf
from tests.reference import assert_greedy_parity, assert_parity_floor, greedy_batched

LENGTHS = [1, 3, 15, 16, 17, 40, 90, 150]
MAX_TOKENS = 32
WINDOW = 16  # make_model's tiny Gemma 3


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in LENGTHS]


def _parity(model: Path, ps: list[list[int]], outs: list, what: str) -> int:
    equal = 0
    refs = greedy_batched(model, ps, MAX_TOKENS)  # one batched transformers run, cached on disk
    for p, o, r in zip(ps, outs, refs, strict=True):
        assert o.finish_reason == "length" and o.completion_tokens == MAX_TOKENS
        equal += assert_greedy_parity(o.token_ids, r, f"{what} len {len(p)}")
    return equal


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "tied,opts",
    [
        # prompts chunked by 64 beside decodes; the sliding layers' own pool (the default)
        (True, {"async_scheduling": True, "max_num_batched_tokens": 64}),
        # every layer's KV in the one pool: the sliding layers mask by their window only
        (
            False,
            {
                "async_scheduling": False,
                "page_size": 4,
                "chunked_prefill_tokens": 40,
                "sliding_window_kv": False,
            },
        ),
    ],
    ids=["tied-async-chunked-own-pool", "untied-sync-pages4-shared-pool"],
)
def test_greedy_parity_with_transformers_and_prefix_hits(
    tied: bool, opts: dict, tiny_model, launch_client
) -> None:
    model = tiny_model("gemma3", tie_embeddings=tied)
    client = launch_client(model, debug_integrity=True, **opts)
    ps = prompts()
    outs = client.generate_batch(ps, GREEDY, progress=False)
    equal = _parity(model, ps, outs, "gemma3")
    assert equal >= len(ps) - 2, f"only {equal}/{len(ps)} equal"
    st = client.stats()
    if opts.get("sliding_window_kv", True):
        # The requests ended: the cache holds all of their full slots, of their sliding KV the last window.
        assert st.kv_cached == sum(len(p) + MAX_TOKENS - 1 for p in ps)
        assert 0 < st.swa_kv_pool_size - st.swa_kv_free <= len(ps) * WINDOW
    else:
        assert st.swa_kv_pool_size == 0
    # The conversations go on: each prompt is an earlier one with its output and more; the cache serves the
    # earlier part (from its tail, where the window before it still has its sliding KV).
    more = [p + o.token_ids + p[:7] for p, o in zip(ps[-3:], outs[-3:], strict=True)]
    outs2 = client.generate_batch(more, GREEDY, progress=False)
    assert client.stats().prefill_tokens - st.prefill_tokens < sum(map(len, more)) // 2, "no prefix-cache hit"
    equal = _parity(model, more, outs2, "gemma3 continued")
    assert equal >= len(more) - 1, f"only {equal}/{len(more)} continued conversations equal"
    check_idle_engine(client)


def test_bf16_greedy_parity_with_transformers_bf16(tiny_model, launch_client) -> None:
    """bf16 (what --dtype auto picks for a directory on this kind of CPU) against transformers in bf16, under
    the near-tie rule at bf16's tolerance; Gemma's norms scale in float32 and round once, as transformers'."""
    import torch

    from tests.reference import NEAR_TIE_BF16, greedy

    model = tiny_model("gemma3")
    client = launch_client(model, dtype="bfloat16")
    ps = prompts(seed=5)[2::2]
    outs = client.generate_batch(
        ps, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), progress=False
    )
    equal = sum(assert_greedy_parity(o.token_ids, greedy(model, p, 16, torch.bfloat16), f"bf16 len {len(p)}",
                                     NEAR_TIE_BF16) for p, o in zip(ps, outs, strict=True))
    # every one matched in full when measured; one may take a near-tie on another CPU's bf16 kernels
    assert equal >= len(ps) - 1, f"only {equal}/{len(ps)} sequences equal"
    check_idle_engine(client)


def test_tp2_with_one_kv_head_gives_transformers_greedy_tokens(tiny_model, launch_client) -> None:
    model = tiny_model("gemma3")
    ps = prompts(seed=2)[::2]
    tp2 = launch_client(model, tp_size=2, max_num_batched_tokens=128)
    two = [o.token_ids for o in tp2.generate_batch(ps, GREEDY, progress=False)]
    # TP=1 is held to the same reference above, with the same floor
    refs = greedy_batched(model, ps, MAX_TOKENS)
    assert_parity_floor([(t, r, f"TP=2 len {len(p)}") for p, t, r in zip(ps, two, refs, strict=True)], max_detours=2)
    check_idle_engine(tp2)


def test_gguf_file_is_its_directorys_model(tiny_model, tmp_path) -> None:
    """llama.cpp's layout (norms stored as 1 + w, the pattern as per-layer flags, local RoPE base, softcap,
    linear scaling) read back: F32 gives the directory's logits exactly. (Quantized files run through the
    CPU step graph in tests/kernels/test_cpu_step_graph.py, and Gemma 3 270M's in
    tests/test_gemma3_270m.py.)"""
    import torch

    from tandem.worker.loader import load_model
    from tests.kv_pool import Pool

    model = tiny_model("gemma3")
    f32 = write_gguf(model, tmp_path / "g-f32.gguf", "F32")
    info = read_model_info(f32)
    assert info.sliding_window == WINDOW and info.architecture == "Gemma3ForCausalLM"
    seq = prompts(seed=3)[-2]  # 90 tokens: past the window, within the test pool's rows
    logits = []
    for path in (model, f32):
        m = load_model(str(path), torch.float32, "cpu")
        pool = Pool(m)
        logits.append(m.forward(pool.batch([(pool.add(len(seq)), seq, len(seq))], all_logits=True), pool.kv))
    assert torch.equal(logits[0], logits[1])


def test_serve_answers_chat_through_the_models_template(tiny_model) -> None:
    import httpx2 as httpx

    from tests.served import Served

    served = Served(tiny_model("gemma3"), "--kv-cache-tokens", "4096", "--served-model-name", "g3").ready()
    try:
        body = {"model": "g3", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
                "temperature": 0}
        r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        assert served.close() == 0


BAD_CONFIGS = {
    "rope_type": (
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        },
        "rope_parameters.full_attention.rope_type: 'yarn' is not supported",
    ),
    "pattern": (
        {"layer_types": None, "sliding_window_pattern": 0},
        "sliding_window_pattern: 0 is not a layer count >= 1",
    ),
    "layer_types": (
        {"layer_types": ["sliding_attention", "local", "full_attention"]},
        "config field layer_types",
    ),
    "window": ({"sliding_window": -4}, "sliding_window: -4 is not a key count"),
}


def _bad_copy(model: Path, out: Path, change: dict) -> Path:
    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(change)
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return out


@pytest.mark.parametrize("which", sorted(BAD_CONFIGS))
def test_bad_config_is_a_model_load_error_naming_the_field(which: str, tiny_model, tmp_path) -> None:
    change, message = BAD_CONFIGS[which]
    bad = _bad_copy(tiny_model("gemma3"), tmp_path / which, change)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(".", r"\.")):
        read_model_info(bad)


@pytest.mark.parametrize("which", ["rope_type", "pattern"])
def test_serve_reports_a_bad_config_in_one_line(which: str, tiny_model, tmp_path) -> None:
    change, message = BAD_CONFIGS[which]
    bad = _bad_copy(tiny_model("gemma3"), tmp_path / which, change)
    r = subprocess.run([sys.executable, "-m", "tandem.launch.cli", "serve", "--model", str(bad)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr
