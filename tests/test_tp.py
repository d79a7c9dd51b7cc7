"""Tensor parallelism on CPU (gloo): two ranks, each loading its shard, match the TP=1 logits."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.ipc import Endpoints
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.loader import load_model

TP = 2
# (name, arch, num_kv_heads): untied llama, qwen2 with q/k/v bias, tied qwen3 with q/k norm, qwen3 with a
# single KV head (fewer KV heads than ranks: replicated), and the MoE archs.
VARIANTS = [
    ("llama", "llama", None), ("qwen2", "qwen2", None), ("qwen3", "qwen3", None), ("qwen3-kv1", "qwen3", 1),
    # MoE: each rank a slice of every expert (worker/layers/moe.py); Qwen2-MoE's shared expert; Mixtral's one
    # KV head replicated
    ("qwen3_moe", "qwen3_moe", None), ("qwen2_moe", "qwen2_moe", None), ("mixtral-kv1", "mixtral", 1),
]
SEQ_LENS = (5, 9, 17, 30)
# Step 1: prefill the first three prompts, one of them in part; step 2: decodes, a prefill chunk and a
# fresh prefill. Entries: (prompt index, first new position, seq_len after the step).
STEPS = [[(0, 0, 4), (1, 0, 8), (3, 0, 12)], [(0, 4, 5), (3, 12, 30), (1, 8, 9), (2, 0, 17)]]


def run_steps(model_dir: str, tp_rank: int = 0, tp_size: int = 1) -> list[torch.Tensor]:
    """All-position logits of each step of STEPS; the slot layout is fixed, so every rank uses the same."""
    model = load_model(model_dir, torch.float32, "cpu", tp_rank=tp_rank, tp_size=tp_size)
    mc = model.config
    kv = KVCache(
        mc.num_hidden_layers, 128, mc.local_kv_heads(tp_size), mc.head_dim, torch.float32, "cpu",
        max_reqs=8, max_context=64,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, mc.vocab_size, (n,), generator=g).tolist() for n in SEQ_LENS]
    slots = torch.randperm(127, generator=g) + 1  # non-contiguous, never the padding slot 0
    rows = [5, 2, 7, 0]
    for i, n in enumerate(SEQ_LENS):
        kv.req_to_token[rows[i], :n] = slots[sum(SEQ_LENS[:i]) : sum(SEQ_LENS[: i + 1])]
    out = []
    for step in STEPS:
        ids, locs, reqs, seq_lens, ext = [], [], [], [], []
        for i, a, b in step:
            ids += prompts[i][a:b]
            locs += kv.req_to_token[rows[i], a:b].tolist()
            reqs.append(rows[i])
            seq_lens.append(b)
            ext.append(b - a)
        batch = ForwardBatch.from_lists(ids, locs, reqs, seq_lens, ext, list(range(len(ids))))
        out.append(model.forward(batch, kv))
    return out


def _rank_main(rank: int, root: str, dirs: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    from tandem.worker.distributed import init_distributed

    d = init_distributed(EngineConfig(model=dirs[0], tp_size=TP, device="cpu"), Endpoints(root), rank)
    assert d is not None
    # The control plane: rank 0's bytes reach every rank; agreement on the smallest value.
    assert d.broadcast_bytes(b"step\x00bytes" if rank == 0 else None) == b"step\x00bytes"
    assert d.broadcast_bytes(b"" if rank == 0 else None) == b""
    assert d.min_int(100 + rank) == 100
    for path in dirs:
        torch.save(run_steps(path, rank, TP), os.path.join(out_dir, f"{Path(path).name}-rank{rank}.pt"))
    d.close()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> list[str]:
    from tandem.launch.make_model import make_model

    base = tmp_path_factory.mktemp("tp-models")
    return [str(make_model(arch, "tiny", base / name, num_kv_heads=kv)) for name, arch, kv in VARIANTS]


def test_tp2_logits_match_tp1(model_dirs: list[str], tmp_path: Path) -> None:
    spawn = mp.get_context("spawn")
    root = tmp_path / "ep"
    root.mkdir()
    procs = [
        spawn.Process(target=_rank_main, args=(r, str(root), model_dirs, str(tmp_path)), daemon=True)
        for r in range(TP)
    ]
    for p in procs:
        p.start()
    ref = {path: run_steps(path) for path in model_dirs}  # TP=1, while the ranks start up
    for p in procs:
        p.join(120)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * TP
    for path in model_dirs:
        name = Path(path).name
        got = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(TP)]
        for step, expected in enumerate(ref[path]):
            # Every rank ends with the full (gathered) logits, identical across ranks.
            torch.testing.assert_close(got[0][step], expected, atol=1e-4, rtol=0, msg=f"{name} step {step}")
            assert torch.equal(got[0][step], got[1][step]), f"{name}: ranks disagree at step {step}"


def test_tp_shapes_and_kv_replication(model_dirs: list[str]) -> None:
    """A rank holds its shard only: vocab rows, heads, and (MQA) the one KV head its queries use."""
    by_name = {Path(p).name: p for p in model_dirs}
    m = load_model(by_name["qwen3-kv1"], torch.float32, "cpu", tp_rank=1, tp_size=TP)
    full = load_model(by_name["qwen3-kv1"], torch.float32, "cpu")
    attn, ref = m.model.layers[0].self_attn, full.model.layers[0].self_attn
    d = attn.head_dim
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    q = ref.qkv_proj.weight[: 4 * d]
    torch.testing.assert_close(attn.qkv_proj.weight[: 2 * d], q[2 * d :])
    torch.testing.assert_close(attn.qkv_proj.weight[2 * d :], ref.qkv_proj.weight[4 * d :])  # replicated k, v
    v = m.config.vocab_size
    assert m.model.embed_tokens.weight.shape[0] == -(-v // TP)
    with pytest.raises(ValueError, match="not divisible"):
        load_model(by_name["llama"], torch.float32, "cpu", tp_rank=0, tp_size=3)


def test_moe_rank_holds_a_slice_of_every_expert(model_dirs: list[str]) -> None:
    """Rank r keeps rows r of each expert's gate and up and the matching columns of its down, and the whole
    router: every rank routes alike and does the same share of each expert's work."""
    path = {Path(p).name: p for p in model_dirs}["qwen3_moe"]
    part = load_model(path, torch.float32, "cpu", tp_rank=1, tp_size=TP).model.layers[1].mlp
    full = load_model(path, torch.float32, "cpu").model.layers[1].mlp

    def weight(ex, name: str) -> torch.Tensor:
        packed = getattr(ex, "packed" + name[1:])  # natively the C layer's panels, else the float tensor
        return packed.dequantize() if packed is not None else getattr(ex, name)

    w13, f13 = weight(part.experts, "w13"), weight(full.experts, "w13")
    inter = f13.shape[1] // 2
    half = inter // TP
    assert w13.shape == (f13.shape[0], 2 * half, f13.shape[2])
    assert torch.equal(w13[:, :half], f13[:, half:inter]) and torch.equal(
        w13[:, half:], f13[:, inter + half :]
    )
    assert torch.equal(weight(part.experts, "w2"), weight(full.experts, "w2")[:, :, half:])
    assert torch.equal(part.gate.weight, full.gate.weight)
