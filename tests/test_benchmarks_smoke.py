"""`tandem bench offline|latency` end to end on a tiny model: the reports hold every field, with sane values.

No timing assertions: this machine's speed is not the test's business.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.benchmarks.cli import main
from tandem.benchmarks.spec_bench import num_requests
from tests.kernels.test_cpu_paged_attention import needs_cc


def _positive(result: dict, *fields: str) -> None:
    for f in fields:
        assert isinstance(result[f], (int, float)) and result[f] > 0, f"{f}={result.get(f)!r}"


@pytest.mark.slow  # a whole benchmark run: the fast tier's minutes go to the engine's own tests
def test_offline_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    rc = main(["offline", "--model", str(tiny_model("llama")), "--num-requests", "4", "--input-len", "8:16",
               "--output-len", "8", "--hf-batch-size", "2", "--kv-cache-tokens", "1024", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    _positive(r, "engine_tok_s", "baseline_tok_s", "ratio", "roofline_tok_s", "roofline_fraction",
              "roofline_prefill_s", "roofline_decode_s", "engine_s", "baseline_s")
    assert r["expected_output_tokens"] == 4 * 8
    assert r["engine_output_tokens"] == 4 * 8 and r["baseline_output_tokens"] == 4 * 8
    assert 4 * 8 <= r["prompt_tokens"] <= 4 * 16
    m = r["machine"]
    _positive(m, "prefill_gflops", "decode_gflops", "bandwidth_gbs")
    s = r["engine_stats"]
    _positive(s, "steps", "schedule_ms_per_step", "worker_busy_ms_per_step")
    assert s["worker_idle_ms_per_step"] >= 0
    # Each request's first token comes from its prefill; the rest are decode tokens.
    # The prefix cache may serve part of the prompts (the warm-up shares their first tokens).
    assert 0 < s["prefill_tokens"] <= r["prompt_tokens"] and s["decode_tokens"] == 4 * (8 - 1)


@pytest.mark.slow  # a whole benchmark run: the fast tier's minutes go to the engine's own tests
def test_latency_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    rc = main(["latency", "--model", str(tiny_model("llama")), "--prompt-len", "16", "--output-len", "16",
               "--num-requests", "1", "--kv-cache-tokens", "1024", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    _positive(r, "engine_ttft_ms", "engine_decode_tok_s", "baseline_decode_tok_s", "ratio",
              "roofline_decode_tok_s", "roofline_fraction", "weight_bytes")
    assert r["engine_output_tokens"] == r["expected_output_tokens"] == 16
    assert len(r["engine_ttft_ms_all"]) == 1 and len(r["baseline_decode_tok_s_all"]) == 1
    _positive(r["engine_stats"], "steps", "worker_busy_ms_per_step")
    assert r["engine_stats"]["decode_tokens"] == 16 - 1


def test_unknown_and_abbreviated_flags_are_rejected(tiny_model) -> None:
    model = str(tiny_model("llama"))
    for extra in (["--bogus", "1"], ["--num-req", "4"]):
        with pytest.raises(SystemExit):
            main(["offline", "--model", model, *extra])


@pytest.mark.slow  # ~5 s each: the three larger benchmarks run in the slow tier (CI runs both)
def test_multiturn_host_tier_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    rc = main(
        [
            "prefix",
            "--model",
            str(tiny_model("llama")),
            "--host-kv-tokens",
            "1024",
            "--conversations",
            "8",
            "--turns",
            "3",
            "--system-len",
            "24",
            "--question-len",
            "8",
            "--output-len",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["total_kv_tokens"] == 8 * (24 + 3 * 10) and r["device_kv_tokens"] == r["total_kv_tokens"] // 4
    for run in (r["host_tier"], r["no_host_tier"]):
        _positive(run, "requests_per_s", "output_tok_s", "prefill_tokens")
        _positive(run["ttft"], "mean_ms", "median_ms", "p90_ms")
        assert len(run["ttft_mean_ms_per_turn"]) == 3
        assert run["integrity"] == "ok"
    assert r["host_tier"]["host_hit_tokens"] > 0 and r["no_host_tier"]["host_hit_tokens"] == 0
    assert r["host_tier"]["prefill_tokens"] < r["no_host_tier"]["prefill_tokens"]
    _positive(r, "ttft_ratio", "throughput_ratio")


@pytest.mark.slow
def test_priority_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    from tandem.benchmarks import priority_bench

    out = tmp_path / "priority.json"
    rc = priority_bench.main(
        [
            "--model",
            str(tiny_model("llama")),
            "--dtype",
            "float32",
            "--num-requests",
            "8",
            "--input-len",
            "16:32",
            "--output-len",
            "4",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    # float32: batch shapes change nothing
    assert r["kv_pool"] == r["kv_demand"] // 4 and r["outputs_equal"] == 8
    for run in r["runs"].values():
        _positive(run["ttft_p50_ms"], "0", "1")
        assert run["integrity"] == "ok"
    _positive(r, "high_over_low_ttft_p50")


@pytest.mark.slow  # a whole benchmark run: the fast tier's minutes go to the engine's own tests
def test_lora_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    out, md = tmp_path / "lora.json", tmp_path / "lora.md"
    rc = main(["lora", "--model", str(tiny_model("llama")), "--adapters", "2", "--rank", "4", "--num-requests",
               "4", "--output-len", "6", "--prompt-len", "8", "--runs", "2", "--out", str(md), "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert {k: len(v) for k, v in r["runs"].items()} == dict.fromkeys(
        ("base", "adapters", "decode_base", "decode_adapter"), 2)
    assert min(min(v) for v in r["runs"].values()) > 0
    assert r["streams_ratio"] == r["median"]["adapters"] / r["median"]["base"]
    assert "Architecture" in md.read_text()  # lscpu beside the figures


@pytest.mark.slow  # a whole benchmark run: the fast tier's minutes go to the engine's own tests
def test_spec_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    rc = main(["spec", "--model", str(tiny_model("llama")), "--batches", "1,2", "--output-len", "6",
               "--num-speculative-tokens", "2", "--kv-cache-tokens", "2048", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["k"] == 2 and set(r["spec_on"]) == set(r["spec_off"]) == {
        f"{w}/{b}" for w in ("repetitive", "open", "random") for b in (1, 2)
    }
    for key, on in r["spec_on"].items():
        off = r["spec_off"][key]
        # draft_tokens counts verified drafts only: the random tiny model's outputs may match no n-gram.
        _positive(on, "tok_s", "tokens", "steps")
        batch = int(key.split("/")[1])
        # 1 -> 4, 2 -> 4
        assert on["requests"] == off["requests"] == num_requests(batch) == batch * (4 // batch)
        assert on["tokens"] == off["tokens"] == 6 * on["requests"]
        assert off["draft_tokens"] == 0 and 0 <= on["acceptance"] <= 1
        assert on["same_outputs"]


def test_attention_step_times_every_cpu_backend_and_checks_they_agree(tiny_model, capsys) -> None:
    from tandem.benchmarks import attention_step

    names = ["torch", "cpu"]
    best = attention_step.main(["--model", str(tiny_model("llama")), "--batch", "3", "--input-len", "8:40",
                                "--decoded", "5", "--repeats", "1", "--backends", ",".join(names)])
    assert list(best) == names and all(ms > 0 for ms in best.values())
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and all(f"{n}:" in out for n in names)


@needs_cc
def test_quant_linear_benchmark_checks_and_times_a_gguf(tiny_model, tmp_path: Path, capsys) -> None:
    from tandem.benchmarks import quant_linear
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_model("qwen3"), tmp_path / "q.gguf", "Q4_1")
    res = quant_linear.main(["--model", str(path), "--rows", "1,9", "--reps", "1", "--int8"])
    assert list(res) == [1, 9] and all(len(row) == 6 and all(ms > 0 for ms in row) for row in res.values())
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "quantized layer weights" in out and "rows     9" in out
    assert out.count("int8 activations: layers") == 2


@needs_cc
@pytest.mark.slow
def test_int8_agreement_benchmark_compares_greedy_runs(tiny_model, tmp_path: Path, capsys) -> None:
    from tandem.benchmarks import int8_agreement
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_model("llama"), tmp_path / "q.gguf", "Q4_1")
    res = int8_agreement.main(["--model", str(path), "--prompts", "3", "--tokens", "6"])
    assert res["identical"] + len(res["first_divergence"]) == 3 and 0 <= res["flips"] <= 18
    out = capsys.readouterr().out
    assert "3 prompts x 6 greedy tokens" in out and "of 18 positions" in out


@needs_cc
def test_int8_kl_benchmark_scores_the_engines_paths_over_real_text(tiny_model, tmp_path: Path, capsys,
                                                                   launch_client) -> None:
    """--kl on a tiny Q4_1 file, 2 chunks of 32 tokens (15 scored each): a path against itself is KL 0 and
    100% top-1 agreement; int8 against exact a finite KL > 0; the int8 path's log-probabilities of the
    text are those the engine gives by default."""
    import math

    import torch

    from tandem import SamplingParams
    from tandem.benchmarks import int8_agreement, int8_kl
    from tests.gguf_files import write_gguf

    path = str(write_gguf(tiny_model("llama"), tmp_path / "q.gguf", "Q4_1"))
    for int8 in (False, True):
        same = int8_kl.measure(path, 2, 32, paths=(int8, int8))
        assert same["positions"] == 30 and same["same_top_pct"] == 100.0 and same["ln_ppl_ratio"] == 0.0
        assert same["kl_mean"] == same["kl_max"] == same["rms_dp_pct"] == 0.0
    res = int8_agreement.main(["--kl", "--model", path, "--chunks", "2", "--ctx", "32"])
    r = res[path]
    assert r["positions"] == 30 and r["types"] == "Q4_1x16"
    assert 0 < r["kl_median"] <= r["kl_p99"] <= r["kl_max"] < math.inf and 0 < r["kl_mean"] <= r["kl_max"]
    assert 0 < r["same_top_pct"] <= 100 and r["ppl_ref"] > 1 and r["ppl_cand"] > 1
    assert math.isclose(r["ln_ppl_ratio"], math.log(r["ppl_cand"] / r["ppl_ref"]), abs_tol=1e-9)
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "2 chunks x 32 tokens, the last 15 of each scored" in out
    assert "| file: int8 vs exact | matrices | PPL exact | PPL int8 |" in out
    assert "| q.gguf | Q4_1x16 |" in out
    # The benchmark's int8 path is the engine's default one: the text's prompt logprobs agree.
    ids = int8_kl.text_chunks(int8_kl.load_tokenizer(path), int8_kl.corpus(), 1, 32)[0]
    lp = int8_kl.LogitPath(path, True, 32).logprobs(ids, 16)
    mine = lp.gather(1, torch.tensor(ids[17:])[:, None])[:, 0]
    client = launch_client(path, cpu_int8_activations=None)
    got = client.generate_batch([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, logprob_start_len=17),
                                progress=False)[0].prompt_logprobs.logprobs
    assert len(got) == len(mine) == 15
    assert torch.allclose(mine, torch.tensor(got, dtype=torch.float32), atol=1e-4)


@needs_cc
def test_kv_kl_benchmark_scores_a_kv_element_against_float32_kv(tiny_model, capsys, launch_client) -> None:
    """--kl --kv-cache-dtype on a tiny Gemma 3 directory (head size 32; sliding layers, a 16-token window),
    2 chunks of 64 tokens (31 scored each): float32 KV against itself is KL 0 and 100% top-1 agreement; q8_0
    KV a finite KL > 0, its log-probabilities of the text those the engine gives with --kv-cache-dtype q8_0
    (the KV stored as q8_0 blocks and read back from the pool, the prefill's own keys too)."""
    import math

    import torch

    from tandem import SamplingParams
    from tandem.benchmarks import int8_agreement, int8_kl

    model = str(tiny_model("gemma3"))
    same = int8_kl.measure(model, 2, 64, kv_dtype="float32")
    assert same["positions"] == 62 and same["same_top_pct"] == 100.0 and same["ln_ppl_ratio"] == 0.0
    assert same["kl_mean"] == same["kl_max"] == same["rms_dp_pct"] == 0.0
    res = int8_agreement.main(["--kl", "--kv-cache-dtype", "q8_0", "--model", model, "--chunks", "2",
                               "--ctx", "64"])
    r = res[model]
    assert r["positions"] == 62 and r["compare"] == ("float32 KV", "q8_0 KV")
    assert 0 < r["kl_median"] <= r["kl_p99"] <= r["kl_max"] < math.inf and 0 < r["kl_mean"] <= r["kl_max"]
    assert math.isclose(r["ln_ppl_ratio"], math.log(r["ppl_cand"] / r["ppl_ref"]), abs_tol=1e-9)
    out = capsys.readouterr().out
    assert "| file: q8_0 KV vs float32 KV | matrices | PPL float32 KV | PPL q8_0 KV |" in out
    assert f"| {Path(model).name} | F32x" in out
    # The q8_0 path is the engine's: the same loaded model over a pool of q8_0 blocks gives the text's
    # prompt logprobs an engine with q8_0 KV gives (and not the float32 pool's: the element matters here).
    ids = int8_kl.text_chunks(int8_kl.load_tokenizer(model), int8_kl.corpus(), 1, 64)[0]
    ref = int8_kl.LogitPath(model, False, 64)
    cand = ref.with_kv(torch.uint8)
    assert cand.model is ref.model and ref.kv.k[0].dtype == torch.float32
    assert cand.kv.k[0].dtype == cand.kv.v[0].dtype == torch.uint8  # q8_0 blocks' bytes
    targets = torch.tensor(ids[33:])[:, None]
    mine, exact = (p.logprobs(ids, 32).gather(1, targets)[:, 0] for p in (cand, ref))
    client = launch_client(model, kv_cache_dtype="q8_0")
    got = torch.tensor(client.generate_batch([ids], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                   logprob_start_len=33),
                                             progress=False)[0].prompt_logprobs.logprobs)
    assert len(got) == len(mine) == 31
    assert torch.allclose(mine, got, atol=1e-4) and not torch.allclose(exact, got, atol=1e-4)


@needs_cc
def test_step_graph_nodes_times_every_kind_of_a_quantized_step(tiny_model, tmp_path: Path, capsys) -> None:
    from tandem.benchmarks import step_graph_nodes
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_model("llama"), tmp_path / "q.gguf", "Q4_1")
    res = step_graph_nodes.main(
        [
            "--model",
            str(path),
            "--cpu-int8-activations",
            "--context",
            "12",
            "--reps",
            "3",
            "--kv-cache-dtype",
            "float16",
        ]
    )
    _positive(res, "step_ms", "replay_ms", "all_nodes_ms", "linear_alone_ms", "attention_alone_ms")
    kinds = {"embed", "norm", "linear", "rotary", "kv_write", "attention", "silu_mul", "argmax"}
    assert {k.removesuffix("_in_step_ms") for k in res if k.endswith("_in_step_ms")} == kinds
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "context 12, kv torch.float16, int8 activations True" in out
    with pytest.raises(SystemExit):
        step_graph_nodes.main(["--model", str(path), "--context", "1"])


def test_attention_step_times_each_backend_on_each_kv_dtype(tiny_model, capsys) -> None:
    from tandem.benchmarks import attention_step

    best = attention_step.main(["--model", str(tiny_model("llama")), "--batch", "3", "--input-len", "8:40",
                                "--decoded", "5", "--repeats", "1", "--backends", "torch,cpu",
                                "--kv-dtypes", "float32,float16,bfloat16"])
    assert list(best) == ["torch", "cpu", "torch/float16", "cpu/float16", "torch/bfloat16", "cpu/bfloat16"]
    assert all(ms > 0 for ms in best.values())
    assert all(line.endswith("x torch") for line in capsys.readouterr().out.splitlines()[-6:])  # to the first


@needs_cc
def test_quant_linear_benchmark_times_each_type_against_the_first(capsys) -> None:
    from tandem.benchmarks import quant_linear

    res = quant_linear.main(
        [
            "--types",
            "Q4_1,Q5_0,Q6_K",
            "--shape",
            "40x256",
            "--layers",
            "2",
            "--rows",
            "1,3",
            "--reps",
            "1",
            "--threads",
            "1",
        ]
    )
    assert list(res) == [1, 3] and all(list(r) == ["Q4_1", "Q5_0", "Q6_K"] for r in res.values())
    assert all(ms > 0 for r in res.values() for ms in r.values())
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "ratio to Q4_1" in out and "rows    3 Q6_K" in out


@needs_cc
def test_attention_step_times_a_prefill_too(tiny_model, capsys) -> None:
    from tandem.benchmarks import attention_step

    best = attention_step.main(
        [
            "--model",
            str(tiny_model("llama")),
            "--batch",
            "2",
            "--input-len",
            "8:40",
            "--decoded",
            "0",
            "--new-tokens",
            "40",
            "--repeats",
            "1",
            "--backends",
            "torch,cpu",
        ]
    )
    assert list(best) == ["torch", "cpu"] and all(ms > 0 for ms in best.values())
    assert ", " in capsys.readouterr().out  # "... mean context N, Q queries"


@needs_cc
def test_cpu_ops_benchmark_times_each_kernel_against_torch(capsys) -> None:
    from tandem.benchmarks import cpu_ops

    res = cpu_ops.main(["--hidden", "64", "--intermediate", "96", "--heads", "4", "--kv-heads", "2",
                        "--head-dim", "16", "--rows", "1,3", "--reps", "1", "--calls", "2"])
    assert len(res) == 6 and all(t["c"] > 0 and t["torch"] > 0 for t in res.values())
    assert capsys.readouterr().out.startswith("CPU: ")


@needs_cc
def test_moe_layer_benchmark_times_the_layer_against_the_dense_mlp(capsys) -> None:
    from tandem.benchmarks import moe_layer

    moe_layer.main(
        ["--hidden", "64", "--moe-intermediate", "32", "--experts", "4", "--rows", "1,20", "--reps", "2"]
    )
    out = capsys.readouterr().out
    assert "dense MLP 64" in out and out.count("MoE / dense") == 2, out


def test_serve_client_reads_only_sse_data_lines() -> None:
    from tandem.benchmarks.serve_client import _data

    assert _data(b": keep-alive") == b""  # a comment: no data
    assert _data(b"event: delta\r\ndata: {\"a\": 1}") == b'{"a": 1}'
    assert _data(b"data: [DONE]") == b"[DONE]"
    assert _data(b"data: {\"a\":\ndata: 2}") == b'{"a":\n2}'  # a payload split over data lines


def test_sliding_window_kv_benchmark_compares_the_two_pools(tiny_model, tmp_path: Path, capsys) -> None:
    """A request well past the window holds less KV with the sliding layers' own pool, for the same tokens."""
    from tandem.benchmarks.sliding_window_kv import main as sliding_main

    out = tmp_path / "swkv.json"
    rc = sliding_main(["--model", str(tiny_model("gemma3")), "--prompt-tokens", "200", "--max-tokens", "8",
                       "--chunk", "64", "--random-prompt", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["same_tokens"] and r["sliding_window_kv_with"] and not r["sliding_window_kv_without"]
    assert r["full_slots_peak_without"] == 200 + 8 - 1 and r["sliding_slots_peak_without"] == 0
    # Without: every layer's KV for every position; with: the global layers' so, the sliding ones' for a
    # window and a chunk at most.
    assert r["sliding_slots_peak_with"] <= r["window"] + 64
    assert r["kv_bytes_peak_without"] == r["full_slots_peak_without"] * r["bytes_per_full_slot_without"]
    assert 0 < r["kv_peak_ratio"] < 1
    assert "KV in use at peak" in capsys.readouterr().out


def test_gguf_to_f32_keeps_every_key_and_the_dequantized_values(tiny_model, tmp_path: Path) -> None:
    import gguf
    import torch

    from tandem.benchmarks.gguf_to_f32 import to_f32
    from tandem.protocol.model_config import read_model_config
    from tandem.worker.gguf_weights import iter_gguf_weights
    from tests.gguf_files import write_gguf

    src = write_gguf(tiny_model("llama"), tmp_path / "q.gguf", "Q4_1")
    dst = to_f32(src, tmp_path / "f32.gguf")
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert {t.tensor_type for t in b.tensors} == {gguf.GGMLQuantizationType.F32}
    assert {t.tensor_type for t in a.tensors} != {gguf.GGMLQuantizationType.F32}
    assert b.fields[gguf.Keys.General.FILE_TYPE].contents() == gguf.LlamaFileType.ALL_F32
    same = [k for k in a.fields if not k.startswith("GGUF.")]  # the header counts: one more key here
    assert all(a.fields[k].contents() == b.fields[k].contents() for k in same)
    cfg = read_model_config(src)
    quant = dict(iter_gguf_weights(src, cfg, torch.float32))
    full = dict(iter_gguf_weights(dst, read_model_config(dst), torch.float32))
    assert quant.keys() == full.keys() and all(torch.equal(quant[k], full[k]) for k in quant)
    half = to_f32(src, tmp_path / "bf16.gguf", bf16=True)  # what `--dtype auto` multiplies with on AMX
    c = gguf.GGUFReader(half)
    assert c.fields[gguf.Keys.General.FILE_TYPE].contents() == gguf.LlamaFileType.MOSTLY_BF16
    assert {len(t.shape) > 1 for t in c.tensors if t.tensor_type == gguf.GGMLQuantizationType.BF16} == {True}
    rounded = dict(iter_gguf_weights(half, read_model_config(half), torch.float32))
    for k, w in full.items():  # matrices rounded (to nearest even, as torch rounds), vectors kept
        assert torch.equal(rounded[k], w.to(torch.bfloat16).float() if w.dim() > 1 else w), k
    assert any(not torch.equal(rounded[k], full[k]) for k in full)


def test_bf16_logit_error_benchmark_measures_both_paths(tiny_model) -> None:
    from tandem.benchmarks.bf16_logit_error import gap_movements

    moved = gap_movements(str(tiny_model("llama")), prompts=2, tokens=4, seed=1)
    assert set(moved) == {"bf16 weights, f32 activations", "all bf16"}
    for xs in moved.values():
        assert len(xs) > 2 * 4 and min(xs) >= 0 and max(xs) > 0  # bf16 does move the gaps


@pytest.mark.slow  # an engine launch: the fast tier is near its 10 minutes
def test_bf16_logit_error_benchmark_measures_the_engine(tiny_model) -> None:
    """--engine: the engine's logprobs at every prefill and decode position against transformers'. float32
    against float32 moves nothing, so a position misaligned by one (or a row of another prompt) shows."""
    from tandem.benchmarks.bf16_logit_error import engine_movements

    moved = engine_movements(str(tiny_model("llama")), prompts=3, tokens=4, seed=1, dtype="float32")
    assert set(moved) == {"prefill", "decode, 1 row", "decode, 3 rows"}
    assert len(moved["prefill"]) >= 3 * 8 and len(moved["decode, 1 row"]) == len(moved["decode, 3 rows"]) == 3 * 3
    assert max(max(xs) for xs in moved.values()) < 1e-3, {k: max(xs) for k, xs in moved.items()}


@pytest.mark.slow  # the scenario holds its unread streams 10 s
def test_abuse_benchmark_reports_its_bounds_and_the_engine_answers_after(tiny_model, tmp_path: Path) -> None:
    """`tandem bench abuse` at a small size: streams past the HTTP door's cap are refused with 503, an
    over-large body is 413 (by its length and chunked), every grammar compiles, each process's RSS is
    reported, and the engine still answers and stops cleanly (exit 0)."""
    rc = main(["abuse", "--model", str(tiny_model("llama")), "--dtype", "float32", "--kv-cache-tokens", "4096",
               "--max-concurrent-requests", "8", "--streams", "24", "--stream-tokens", "8",
               "--max-request-bytes", str(2**20), "--body-mb", "2", "--grammars", "6",
               "--result-dir", str(tmp_path), "--label", "t"])
    r = json.loads((tmp_path / "t.json").read_text())
    assert rc == 0 and r["still_answering"] is True and r["exit_code"] == 0, r
    statuses = r["unread_streams"]["statuses"]
    assert sum(statuses.values()) == 24 and statuses.get("503", 0) >= 24 - 8, statuses
    assert set(statuses) <= {"200", "503", "no answer yet (queued)"}, statuses
    assert r["huge_body"]["with_content_length"]["status"] == 413, r["huge_body"]
    assert r["huge_body"]["chunked"]["status"] == 413, r["huge_body"]
    assert r["grammars"]["at_once"] == {"ok": 6} and r["grammars"]["32_at_a_time"] == {"ok": 6}, r["grammars"]
    for scenario in ("unread_streams", "huge_body", "grammars"):
        rss = r[scenario]["rss"]
        assert len(rss) >= 4 and all(v["peak_mb"] >= v["before_mb"] > 0 for v in rss.values()), rss


def test_vs_llamacpp_row_puts_each_run_in_its_column() -> None:
    from tandem.benchmarks.vs_llamacpp import DECODE as HEADER
    from tandem.benchmarks.vs_llamacpp import decode_row as row

    run = {"llama_cpp": {"tg_tok_s": 20.04, "tg_std": 0.51}, "engine_decode_tok_s": 30.06,
           "ratio_vs_llama_cpp": 1.5, "roofline_fraction": 0.8}
    exact = {**run, "engine_decode_tok_s": 40.0, "ratio_vs_llama_cpp": 2.0}
    assert row("Q4_0", run, exact) == "| Q4_0 | 20.0 ± 0.5 | 30.1 | 1.50 | 0.80 | 40.0 | 2.00 |"
    assert row("BF16", run, None).endswith("| – | – |")
    assert all(line.count("|") == 8 for line in HEADER.splitlines())


@pytest.mark.slow
def test_vision_benchmark_reports(tiny_model, tmp_path: Path) -> None:
    from tandem.benchmarks.vision_ttft import main

    out = tmp_path / "vision.md"
    assert main(["--model", str(tiny_model("gemma3_vision")), "--runs", "1", "--busy", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "TTFT, 1 image" in text and "transformers generate" in text and "Architecture:" in text
