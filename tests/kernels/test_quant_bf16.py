"""A GGUF weight widened to bfloat16 for many rows' products (kernels/csrc/quant_bf16.c, Ops.bf16_block_rows):
every type's floats rounded to bf16 exactly as torch rounds the reference's (quant_pack.dequantize), a
fused weight's parts in their own rows, and the product linear_product takes from Ops.bf16_block_rows rows
the plain torch product of those bf16 weights; below it, the int8 kernel's; the step graph records only
batches below it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.linear_product import linear_product
from tandem.kernels.native import quant_bf16
from tandem.kernels.native.quant_linear import quant_linear
from tandem.kernels.native.quant_pack import GGUF_BLOCKS, QuantRows, dequantize, pack
from tests.c_kernels import needs_c_kernels
from tests.kernels.test_quant_repack import _k, _raw

pytestmark = needs_c_kernels


def test_the_library_builds() -> None:
    assert quant_bf16.available()


@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
@pytest.mark.parametrize("n", [1, 16, 37, 64])
def test_every_type_widens_to_the_references_bf16(qtype: str, n: int) -> None:
    k = _k(qtype, 2 if qtype in ("Q4_K", "Q5_K", "Q6_K") else 5)
    w = pack(_raw(qtype, n, k, seed=n), qtype, k)
    for threads in (1, 2, 3):
        got = quant_bf16.dequantize_bf16(w, threads=threads)
        assert got.shape == (n, k) and got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), dequantize(w).to(torch.bfloat16).view(torch.int16)), threads


def test_a_fused_weights_parts_land_in_their_own_rows() -> None:
    k = _k("Q4_K", 2)
    parts = (pack(_raw("Q4_K", 40, k, seed=1), "Q4_K", k), pack(_raw("Q6_K", 9, k, seed=2), "Q6_K", k),
             pack(_raw("Q8_0", 16, k, seed=3), "Q8_0", k))
    got = quant_bf16.dequantize_bf16(QuantRows(parts))
    want = torch.cat([dequantize(p) for p in parts]).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_many_rows_take_the_bf16_product_and_few_the_int8_kernel() -> None:
    k = _k("Q4_0", 24)
    w = pack(_raw("Q4_0", 48, k, seed=4), "Q4_0", k)  # finite scales: finite products to compare
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(48, generator=g)
    for rows in (3, 7, 8, 40):
        x = torch.randn(rows, k, generator=g)
        got = linear_product(x, w, None, None, None, bias, int8=True, bf16_rows=8)
        if rows >= 8:
            want = F.linear(x.to(torch.bfloat16), dequantize(w).to(torch.bfloat16)).float() + bias
        else:
            want = quant_linear(x, w, int8=True) + bias
        assert torch.equal(got, want), rows
    x = torch.randn(40, k, generator=g)
    assert torch.equal(linear_product(x, w, None, None, None, None, int8=True), quant_linear(x, w, int8=True))


def test_a_float_weight_is_refused() -> None:
    from tandem.kernels.native.quant_pack import dense

    with pytest.raises(ValueError, match="GGUF blocks"):
        quant_bf16.dequantize_bf16(dense(torch.zeros(4, 32)))


def test_the_step_graph_records_only_batches_below_the_bf16_rows(tiny_model) -> None:
    """Replay == eager: a recording serves decode batches only where the eager product is the int8 kernel."""
    from tandem.kernels.ops import resolve_ops
    from tandem.worker.cpu_step_graph import graph_batch
    from tandem.worker.loader import load_model
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_model("llama"), tiny_model("llama").parent / "graph-bf16-Q4_1.gguf", "Q4_1")
    for int8 in (True, False):
        ops = resolve_ops("cpu", torch.float32, "cpu", int8)
        model = load_model(str(path), torch.float32, "cpu", ops=ops)
        model.pack_cpu_weights()
        rows = ops.bf16_block_rows
        assert graph_batch(model, 4096) == (4096 if rows is None else rows - 1), (int8, rows)
