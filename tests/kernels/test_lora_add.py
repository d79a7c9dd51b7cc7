"""Ops.lora_add on every implementation this machine has (the torch twin by groups and by slots alone, the C
kernel, the Triton kernel interpreted, each Ops' choice) against a row-by-row twin; and a decode step mixing
adapters through worker/decode_graphs.py's padded static batch (the path a CUDA graph captures, its rows'
slots a static buffer) against the eager forward. The captured graphs: tests/kernels/test_gpu.py."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native import lora as native_lora
from tandem.kernels.ops import Ops, resolve_ops
from tandem.kernels.reference.lora import LoraRows, lora_add_ref
from tandem.kernels.triton.lora import lora_add_triton
from tandem.worker.decode_graphs import DecodeGraphs
from tandem.worker.layers.lora import install_slots, lora_layers
from tandem.worker.loader import load_model
from tests.kernels.ops_variants import cpu_triton, ops_params, ops_variants, triton_runs
from tests.kernels.portable_build import march_build, portable_build, x86_only
from tests.kv_pool import Pool

F32 = torch.float32


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)  # sums of 72 products, in any order


def grouped(slot_of: torch.Tensor) -> LoraRows:
    """The rows by adapter, as the worker's step gives them (lora_step.lora_groups)."""
    return LoraRows(slot_of, [(s, torch.nonzero(slot_of == s).flatten()) for s in sorted(set(slot_of.tolist()))
                              if s >= 0])


def twin(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_of: torch.Tensor
         ) -> torch.Tensor:
    want = y.clone()
    for i, s in enumerate(slot_of.tolist()):
        if s >= 0:
            want[i] += (a[s] @ x[i]) @ b[s]
    return want


@pytest.mark.parametrize("rows", [1, 6, 13])  # blocks of 4 rows and remainders; threads split from 4
def test_every_implementation_gives_each_row_its_own_adapters_delta(rows: int) -> None:
    assert native_lora.available(), "the LoRA C kernel did not build"
    g = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, 72, generator=g), torch.randn(rows, 70, generator=g)
    # a fused layer of two parts (columns 0..46 and 46..70), room for rank 4 each (rows 0..4 and 4..8 of a
    # and b), the slots' adapters of ranks 4, 2 and 3: b block-diagonal over the parts, zeros past the ranks
    a, b = torch.randn(3, 8, 72, generator=g), torch.randn(3, 8, 70, generator=g)
    b[:, :4, 46:] = 0
    b[:, 4:, :46] = 0
    ranks = torch.tensor([4, 2, 3])
    unused = torch.zeros(3, 8, dtype=torch.bool)
    for s, rank in enumerate(ranks.tolist()):
        unused[s, rank:4] = unused[s, 4 + rank:] = True
    a[unused], b[unused] = 0.0, 0.0
    cols = torch.tensor([0, 46, 70])
    slot_of = torch.randint(-1, 3, (rows,), generator=g)
    impls = [lora_add_ref, native_lora.lora_add] + [o.lora_add for o in ops_variants()]
    kernels = [native_lora.lora_add] + ([lora_add_triton] if triton_runs(torch.device("cpu")) else [])
    wide = torch.randn(rows, 90, generator=g)[:, 5:77]  # a view: rows apart by 90
    want = twin(y, x, a, b, slot_of)
    for impl in impls + kernels:
        for rows_given in (grouped(slot_of), LoraRows(slot_of)):  # by groups, and by slots alone (a graph's)
            if impl in kernels or rows_given.groups:
                close(impl(y.clone(), x, a, b, rows_given, cols, ranks), want)
        one = torch.full((rows,), 1)
        close(impl(y.clone(), x, a, b, LoraRows(one, [(1, None)]), cols, ranks), y + x @ a[1].t() @ b[1])
        close(impl(y.clone(), wide, a, b, grouped(slot_of), cols, ranks),
              twin(y, wide.contiguous(), a, b, slot_of))
    close(lora_add_ref(y.clone(), x, a, b, LoraRows(slot_of), cols, ranks), want)
    # the kernels read no row past a slot's rank: garbage there changes nothing
    a[unused], b[unused] = float("nan"), float("nan")
    for impl in kernels:
        close(impl(y.clone(), x, a, b, LoraRows(slot_of), cols, ranks), want)
    # and any thread count gives the same bits (the C kernel's rows split over threads)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = native_lora.lora_add(y.clone(), x, a, b, LoraRows(slot_of), cols, ranks)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, native_lora.lora_add(y.clone(), x, a, b, LoraRows(slot_of), cols, ranks))


@x86_only
@pytest.mark.parametrize("build", ["portable", "haswell"])  # no AVX at all, and AVX2 without AVX-512
def test_other_builds_give_the_same_deltas(build: str, tmp_path, monkeypatch) -> None:
    lib = portable_build(native_lora.SOURCE, tmp_path) if build == "portable" else march_build(
        native_lora.SOURCE, tmp_path, build)
    monkeypatch.setattr(native_build, "load", lambda source, what: lib)
    native_lora._library.cache_clear()
    try:
        g = torch.Generator().manual_seed(9)
        x, y = torch.randn(21, 100, generator=g), torch.randn(21, 150, generator=g)
        a, b = torch.randn(2, 4, 100, generator=g), torch.randn(2, 4, 150, generator=g)
        slot_of, ranks, cols = torch.randint(-1, 2, (21,), generator=g), torch.tensor([4, 4]), torch.tensor([0, 150])
        close(native_lora.lora_add(y.clone(), x, a, b, LoraRows(slot_of), cols, ranks), twin(y, x, a, b, slot_of))
    finally:
        native_lora._library.cache_clear()


def _filled(model: torch.nn.Module, slots: int, rank: int, seed: int) -> None:
    """Random adapters in every slot of every target layer (a rank below the slots' room: zeros past it)."""
    g = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model).values():
        s = layer.lora
        s.ranks.fill_(rank)
        for p, (o, n) in enumerate(s.parts):
            r0 = p * s.max_rank
            s.a[:, r0 : r0 + rank] = torch.randn(slots, rank, s.a.shape[2], generator=g) / s.a.shape[2] ** 0.5
            s.b[:, r0 : r0 + rank, o : o + n] = torch.randn(slots, rank, n, generator=g) * 0.3


def replay_steps_as_eager(model: torch.nn.Module, device: torch.device, capture: bool,
                          atol: float) -> dict[tuple[int, ...], torch.Tensor]:
    """Decode steps mixing adapters (and the base alone) through DecodeGraphs against model.forward: the
    eager logits of each step's slots."""
    ctx = install_slots(model, 3, 8, F32, device)
    _filled(model, 3, 4, seed=1)
    pool = Pool(model, num_slots=600, max_reqs=16, device=device)
    pool.free_slots.remove(0)  # the padding slot
    graphs = DecodeGraphs(model, pool.kv, max_batch=8, max_context=128, capture=capture)
    g = torch.Generator().manual_seed(5)
    lens = [3, 9, 14, 20, 6]
    seqs = [torch.randint(0, 500, (n + 4,), generator=g).tolist() for n in lens]
    rows = [pool.add(len(s)) for s in seqs]
    model.forward(pool.batch([(r, s[:n], n) for r, s, n in zip(rows, seqs, lens, strict=True)]), pool.kv)
    eager_of = {}
    for size, slots in ((5, [0, -1, 2, 1, 0]), (3, [2, 2, 2]), (5, [-1] * 5)):
        batch = pool.batch([(rows[i], [seqs[i][lens[i]]], lens[i] + 1) for i in range(size)])
        ctx.groups = None if max(slots) < 0 else grouped(torch.tensor(slots, device=device))
        before = [t.clone() for t in pool.kv.k + pool.kv.v]
        eager = model.forward(batch, pool.kv)
        for t, old in zip(pool.kv.k + pool.kv.v, before, strict=True):
            t.copy_(old)
        torch.testing.assert_close(graphs.run(batch), eager, atol=atol, rtol=0)
        assert graphs.lora_slots[size:graphs.bucket(size)].eq(-1).all()  # padding rows run the base
        eager_of[tuple(slots)] = eager
        ctx.groups = None
    return eager_of


@pytest.mark.parametrize("ops", ops_params() + [pytest.param("triton-attention", marks=cpu_triton)])
def test_decode_graphs_replay_a_step_mixing_adapters_as_eager(tiny_model, ops: Ops | str) -> None:
    """Every Ops here (its lora_add: C, torch, Triton interpreted), and the Triton attention backend."""
    if isinstance(ops, str):
        ops = resolve_ops("cpu", F32, "triton")
    model = load_model(tiny_model("llama"), F32, "cpu", ops=ops)
    eager_of = replay_steps_as_eager(model, torch.device("cpu"), capture=False, atol=1e-5)
    mixed, base = eager_of[(0, -1, 2, 1, 0)], eager_of[(-1,) * 5]  # the same tokens at the same positions
    assert torch.equal(mixed[1], base[1])  # the base's row in a mixed step is the base's
    assert all((mixed[i] - base[i]).abs().max() > 1e-3 for i in (0, 2, 3, 4))  # the adapters' rows are not
