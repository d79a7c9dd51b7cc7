"""LoRA adapters against PEFT (transformers' model with peft's adapters, a reference that shares no code with
the engine): adapters' greedy tokens through `Client.launch` in one batch with the base's (the kernels:
tests/kernels/test_lora_add.py), the prefix cache kept apart per adapter, and every bad adapter a
one-line error naming its field."""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from tandem import AsyncClient, SamplingParams
from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.lora import LoraRows
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode, InvalidRequestError, RequestFailedError
from tandem.protocol.lora import LoraError, LoraModule, read_lora
from tests.reference import NEAR_TIE

F32 = torch.float32
N = 8  # tokens generated per request


def test_a_session_turn_continues_only_under_its_own_adapter() -> None:
    """A session's held KV is taken as it is: a turn under another adapter (or the base) is refused."""
    from tandem.protocol.messages import TokenizedRequest
    from tandem.scheduler.request_checks import refusal
    from tandem.scheduler.sessions import Turn

    turn = Turn("t1", [1, 2, 3], None, lora="a")
    for lora, refused in (("a", False), ("b", True), (None, True)):
        msg = TokenizedRequest("r", [4, 5], SamplingParams(), lora=lora)
        err = refusal(msg, [1, 2, 3, 4, 5], 100, 1000, None, 0, turn)
        assert (err is not None) == refused
        if err is not None:
            assert err.code == ErrorCode.SESSION_TURN and "one adapter" in err.message


def _adapter(base: Path, out: Path, seed: int, r: int, targets: list[str], rslora: bool = False) -> Path:
    """A random PEFT adapter (B not zero, as a trained one), saved as PEFT saves it."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=F32)
    pm = get_peft_model(hf, PeftLoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=rslora,
                                           init_lora_weights=False))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    pm.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=8)
def _peft_model(base: Path, adapter: Path | None) -> torch.nn.Module:
    from peft import PeftModel

    if base.suffix == ".gguf":  # transformers' own GGUF reader: its dequantization, none of the engine's
        hf = AutoModelForCausalLM.from_pretrained(str(base.parent), gguf_file=base.name, dtype=F32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=F32).eval()
    return PeftModel.from_pretrained(hf, adapter).eval() if adapter is not None else hf


def _peft_greedy(base: Path, adapter: Path | None, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    m = _peft_model(base, adapter)  # loaded once per base and adapter
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [lg[0] for lg in out.logits]


def _check(got: list[int], want: tuple[list[int], list[torch.Tensor]], what: str) -> None:
    """Equal, or equal up to a near-tie of the reference's own logits (after which the runs may part)."""
    tokens, logits = want
    for i, (a, b) in enumerate(zip(got, tokens, strict=True)):
        if a != b:
            gap = float(logits[i][b] - logits[i][a])
            assert gap < NEAR_TIE, f"{what}: token {i} is {a}, PEFT's {b} (ahead by {gap:.4g})"
            return


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    base = tiny_model("llama")
    d = tmp_path_factory.mktemp("lora")
    return base, {
        "all": _adapter(base, d / "all", 1, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]),
        "attn": _adapter(base, d / "attn", 2, 4, ["q_proj", "v_proj"], rslora=True),
        "mlp": _adapter(base, d / "mlp", 3, 16, ["down_proj", "up_proj"]),
        "kg": _adapter(base, d / "kg", 6, 2, ["k_proj", "gate_proj"]),
    }


def test_adapters_and_the_base_in_one_batch_are_each_peft(adapters) -> None:
    """Four adapters and the base interleaved in one batch of 40 requests: each gets PEFT's tokens (the tokens
    it gets alone: the engine's batch is held to the same reference, request by request)."""
    base, paths = adapters
    prompts = [[1, 5, 9, 13, 2, 7], [1, 30, 31, 2], [1, 44, 3, 3, 8, 21, 60, 9], [1, 7, 7, 100, 3]]
    runs = [(p, name) for p in prompts for name in (None, *paths)] * 2
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)

    async def serve() -> list[list[int]]:
        options = {"lora_modules": [f"{n}={p}" for n, p in paths.items()], "max_lora_rank": 16}
        async with AsyncClient.launch(str(base), dtype="float32", **options) as c:
            outs = await asyncio.gather(*(c.generate(p, params, lora=name) for p, name in runs))
            with pytest.raises(InvalidRequestError) as e:
                await c.generate(prompts[0], params, lora="nope")
            assert e.value.code == ErrorCode.LORA and "served: all, attn, mlp, kg" in str(e.value)
            return [o.token_ids for o in outs]

    got = asyncio.run(serve())
    differ, half = 0, len(runs) // 2
    assert got[:half] == got[half:]  # the same request twice in one batch: the same tokens
    for (prompt, name), tokens in zip(runs[:half], got[:half], strict=True):
        want = _peft_greedy(base, paths[name] if name else None, prompt)
        _check(tokens, want, f"{name or 'base'} on {prompt}")
        differ += name is not None and tokens != got[runs.index((prompt, None))]
    assert differ >= 10  # the adapters change what the model says


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_other_families_with_an_adapter_are_peft(arch: str, tiny_model, tmp_path) -> None:
    """Qwen3 (q/k norms) and Gemma 3 (its own norms, GELU, sliding layers): an adapter on every target and
    the base, in one batch, each equal to PEFT's."""
    base = tiny_model(arch)
    path = _adapter(base, tmp_path / "a", 5, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                "up_proj", "down_proj"])
    prompts = [[2, 5, 9, 13, 7], [2, 30, 31, 44, 8, 21]]
    runs = [(p, name) for p in prompts for name in (None, "a")]
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)

    async def serve() -> list[list[int]]:
        async with AsyncClient.launch(str(base), dtype="float32", lora_modules=[f"a={path}"]) as c:
            return [o.token_ids for o in await asyncio.gather(*(c.generate(p, params, lora=n) for p, n in runs))]

    for (prompt, name), tokens in zip(runs, asyncio.run(serve()), strict=True):
        _check(tokens, _peft_greedy(base, path if name else None, prompt), f"{arch} {name or 'base'}")


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_gguf_base_with_an_adapter_is_its_dequantized_model_with_it(qtype: str, adapters, tmp_path) -> None:
    """The adapter on a quantized file's weights (the C kernel's product from blocks, the adapter's beside
    it) against PEFT on transformers' dequantization of the same file."""
    from tests.gguf_files import write_gguf

    base, paths = adapters
    gguf = write_gguf(base, tmp_path / f"base-{qtype}.gguf", qtype)
    prompts = [[1, 5, 9, 13, 2, 7], [1, 30, 31, 2]]
    runs = [(p, name) for p in prompts for name in (None, "all")]
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)

    async def serve() -> list[list[int]]:
        async with AsyncClient.launch(str(gguf), dtype="float32", cpu_int8_activations=False,
                                      lora_modules=[f"all={paths['all']}"], max_lora_rank=16) as c:
            return [o.token_ids for o in await asyncio.gather(*(c.generate(p, params, lora=n) for p, n in runs))]

    for (prompt, name), tokens in zip(runs, asyncio.run(serve()), strict=True):
        _check(tokens, _peft_greedy(gguf, paths["all"] if name else None, prompt), f"{qtype} {name or 'base'}")


@pytest.mark.slow
def test_tensor_parallel_adapters_are_peft(adapters, launch_client) -> None:
    """TP=2 (gloo): each rank holds its part of every adapter as of its layer (a column-parallel layer's rows
    of B, a row-parallel layer's columns of A, whose partial deltas the layer's all-reduce sums); adapters
    and the base in one batch, each equal to PEFT's."""
    base, paths = adapters
    prompts = [[1, 5, 9, 13, 2, 7], [1, 44, 3, 3, 8, 21, 60, 9]]
    runs = [(p, name) for p in prompts for name in (None, *paths)]
    c = launch_client(base, tp_size=2, lora_modules=[f"{n}={p}" for n, p in paths.items()], max_lora_rank=16)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    with ThreadPoolExecutor(len(runs)) as pool:  # all at once: one batch
        got = list(pool.map(lambda run: c.generate(run[0], params, lora=run[1]).token_ids, runs))
    for (prompt, name), tokens in zip(runs, got, strict=True):
        _check(tokens, _peft_greedy(base, paths[name] if name else None, prompt), f"TP=2 {name or 'base'}")


def test_an_adapters_kv_is_never_anothers(adapters) -> None:
    base, paths = adapters
    prompt = list(range(1, 40))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def cached() -> list[int]:
        options = {"lora_modules": [f"{n}={p}" for n, p in paths.items()], "max_lora_rank": 16}
        async with AsyncClient.launch(str(base), dtype="float32", **options) as c:
            out = []
            for name in ("all", "attn", None, "all", "attn", None):
                out.append((await c.generate(prompt, params, lora=name)).final.cached_tokens)
            return out

    first_all, first_attn, first_base, *again = asyncio.run(cached())
    assert first_all == first_attn == first_base == 0  # the same prompt under another adapter: no hit
    assert min(again) >= len(prompt) - 2  # under the same one: its own KV


def test_a_bad_adapter_is_an_error_naming_its_field(adapters, tmp_path) -> None:
    base, paths = adapters
    cases = [
        (LoraModule("x", str(tmp_path / "missing")), 64, "path"),
        (LoraModule("x", str(paths["mlp"])), 8, "r"),  # rank 16 above --max-lora-rank 8
    ]
    for module, max_rank, field in cases:
        with pytest.raises(LoraError) as e:
            read_lora(module, max_rank)
        assert e.value.field == field
    with pytest.raises(LoraError, match="not name=path"):
        LoraModule.parse("no-path")
    with pytest.raises(ValueError, match="two adapters under one name"):
        EngineConfig(model=str(base), lora_modules=[f"a={paths['all']}", f"a={paths['mlp']}"])
    assert EngineConfig(model=str(base), lora_modules=[f"a={paths['all']}", f"b={paths['mlp']}"], max_loras=1)


@pytest.mark.slow  # a whole serving scenario (~5 s): the fast tier keeps under its 10 minutes
def test_load_serve_unload_and_reload_under_traffic_nothing_lost(adapters, tiny_model, tmp_path) -> None:
    """Four adapters through two device slots (swapped in as requests need them), loaded and unloaded while
    requests run: each request gets the tokens it gets alone, a reload never meets its predecessor's KV, an
    unload waits for its requests or fails only them, and the KV pool is whole at the end."""
    base, paths = adapters
    other = _adapter(base, tmp_path / "other", 9, 8, ["q_proj", "o_proj", "up_proj"])
    wrong_base = _adapter(tiny_model("llama", size="small"), tmp_path / "wrong", 4, 4, ["q_proj"])
    prompts = [[1, 5, 9, 13, 2, 7], [1, 30, 31, 2], [1, 44, 3, 3, 8, 21]]
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)

    async def run() -> None:
        async with AsyncClient.launch(str(base), dtype="float32", enable_lora=True, max_loras=2,
                                      max_lora_rank=16) as c:
            for name in paths:
                assert await c.load_lora(name, str(paths[name])) == 1
            bad = [("all", str(paths["all"]), ErrorCode.LORA_CONFLICT, "served as 'all' already"),
                   ("x", str(tmp_path / "nowhere"), ErrorCode.LORA, "path"),
                   ("x", str(wrong_base), ErrorCode.LORA, "base")]
            for name, path, code, words in bad:
                with pytest.raises(InvalidRequestError, match=words) as e:
                    await c.load_lora(name, path)
                assert e.value.code == code
            alone = {(i, n): (await c.generate(p, params, lora=n)).token_ids
                     for i, p in enumerate(prompts) for n in (None, *paths)}
            # all of them at once; an unload of `mlp` meanwhile waits for its requests
            runs = [(i, n) for i in range(3) for n in (None, *paths)] * 2  # 4 adapters, 2 slots
            tasks = [asyncio.create_task(c.generate(prompts[i], params, lora=n)) for i, n in runs]
            await asyncio.sleep(0.05)
            await c.unload_lora("mlp")
            outs = await asyncio.gather(*tasks)
            assert [o.token_ids for o in outs] == [alone[r] for r in runs]
            with pytest.raises(InvalidRequestError, match="no LoRA adapter 'mlp'") as e:
                await c.generate(prompts[0], params, lora="mlp")
            assert e.value.code == ErrorCode.LORA
            assert set((await c.stats()).loras) == {"all", "attn", "kg"}
            # reloaded from other weights: generation 2, none of the first load's KV
            assert await c.load_lora("mlp", str(other)) == 2
            again = await c.generate(prompts[0], params, lora="mlp")
            assert again.final.cached_tokens == 0 and again.token_ids != alone[(0, "mlp")]
            # abort_running: only that adapter's requests fail, the others finish
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            doomed = asyncio.create_task(c.generate(prompts[1], long, lora="attn"))
            spared = asyncio.create_task(c.generate(prompts[1], long, lora="all"))
            await asyncio.sleep(0.1)
            await c.unload_lora("attn", abort_running=True)
            with pytest.raises(RequestFailedError) as e:
                await doomed
            assert e.value.code == ErrorCode.LORA_UNLOADED
            assert len((await spared).token_ids) == 200
            st = await c.stats()
            assert st.integrity == "ok" and st.running == st.waiting == 0
            assert st.kv_free + st.kv_cached == st.kv_pool_size  # nothing held: KV back to full

    asyncio.run(run())


def test_an_adapter_for_another_model_is_refused_before_it_is_served(adapters, tiny_model) -> None:
    from tandem.worker.layers.lora import install_slots
    from tandem.worker.loader import load_model
    from tandem.worker.lora_weights import load_adapter

    _, paths = adapters
    other = load_model(str(tiny_model("llama", size="small")), F32, "cpu")  # wider, more layers
    install_slots(other, 2, 16, F32, "cpu")
    with pytest.raises(LoraError) as e:
        load_adapter(other, 0, read_lora(LoraModule("all", str(paths["all"])), 16))
    assert e.value.field == "base"


def test_the_step_graph_replays_a_decode_step_mixing_adapters_as_eager(adapters) -> None:
    """Each target layer's LoRA node (its rows' slots the replay's input): the replayed logits equal the eager
    step's bit for bit, adapters mixed in the batch and the base's rows (-1) untouched; a base step after it
    replays with no adapter."""
    from tandem.protocol.lora_messages import LoraSlotLoad
    from tandem.worker.cpu_step_graph import CpuStepGraph
    from tandem.worker.loader import load_model
    from tandem.worker.lora_step import WorkerAdapters
    from tests.kernels.test_cpu_step_graph import _kv, _prefilled
    from tests.kv_pool import Pool

    base, paths = adapters
    model = load_model(str(base), F32, "cpu", ops=resolve_ops("cpu", F32))
    model.pack_cpu_weights()
    served = WorkerAdapters(model, 4, 16, F32, torch.device("cpu"))
    served.apply([LoraSlotLoad(i, n, 1, str(p)) for i, (n, p) in enumerate(paths.items())], [])
    pool = Pool(model, num_slots=600, max_reqs=16)
    graph = CpuStepGraph(model, pool.kv, max_batch=8, max_context=128)
    lens = [3, 9, 14, 20, 6]
    seqs, rows = _prefilled(model, pool, lens, seed=5, extra=4)
    for slots in ([0, -1, 2, 1, 0], [-1] * 5, [1] * 5):
        batch = pool.batch([(rows[i], [seqs[i][lens[i]]], lens[i] + 1) for i in range(5)])
        of_row = torch.tensor(slots)
        served.ctx.groups = None if max(slots) < 0 else LoraRows(
            of_row, [(s, torch.nonzero(of_row == s).flatten()) for s in set(slots) if s >= 0])
        before = _kv(pool)
        eager = model.forward(batch, pool.kv)
        for t, b in zip(pool.kv.k + pool.kv.v, before, strict=True):
            t.copy_(b)
        assert torch.equal(graph.run(batch), eager), slots
    served.ctx.groups = None
    assert graph.num_runs == 3


@pytest.mark.slow
def test_speculative_decoding_and_structured_output_run_under_an_adapter(adapters) -> None:
    """n-gram drafts verified under the adapter (the draft rows take its delta) give the tokens greedy
    decoding gives without them; a JSON grammar constrains an adapter's output as the base's."""
    base, paths = adapters
    prompt = [1, 5, 9, 13, 5, 9, 13, 5, 9, 13, 2]  # repetitive: the n-gram proposer has drafts to offer
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    options = {"lora_modules": [f"all={paths['all']}"], "max_lora_rank": 16}

    async def run(spec: bool) -> tuple[list[int], str]:
        extra = {"speculative_method": "ngram", "num_speculative_tokens": 4} if spec else {}
        async with AsyncClient.launch(str(base), dtype="float32", **options, **extra) as c:
            plain = (await c.generate(prompt, greedy, lora="all")).token_ids
            js = await c.generate("Answer:", SamplingParams(max_tokens=32, temperature=0, json_object=True),
                                  lora="all")
            return plain, js.text

    off, on = asyncio.run(run(False)), asyncio.run(run(True))
    assert on == off
    _check(off[0][:N], _peft_greedy(base, paths["all"], prompt), "greedy under the adapter")
