"""The Triton paged-attention kernels against the torch reference, on CPU under the Triton interpreter
(small shapes; tests/kernels/test_gpu.py runs them natively when a GPU is there)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.reference.paged_attention import paged_attention_ref
from tandem.kernels.triton.paged_attention import BLOCK_M, BLOCK_N, paged_attention_triton
from tests.kernels.ops_variants import cpu_triton
from tests.kernels.test_paged_attention import make_case

pytestmark = cpu_triton

CASES = {
    # decodes only: the grouped decode kernel; lengths around the key block edge
    "decodes": [(1, 1), (BLOCK_N, 1), (BLOCK_N + 1, 1), (150, 1), (7, 1)],
    # fresh prefills, a cached prefix, and decodes mixed in: the extend kernel
    "mixed": [(30, 1), (25, 25), (140, 1), (60, 17), (9, 9), (BLOCK_M + 50, BLOCK_M + 3), (2, 1)],
    "prefill-blocks": [(2 * BLOCK_M + 1, 2 * BLOCK_M + 1), (1, 1)],
}


def run_triton(c: dict) -> torch.Tensor:
    ext = c["extend_lens"]
    return paged_attention_triton(
        c["q"], c["k_pool"], c["v_pool"], c["req_to_token"], c["req_pool_indices"], c["seq_lens"], ext,
        c["scale"], cu_lens=torch.cumsum(ext, 0) - ext, max_extend=int(ext.max()),
    )


@pytest.mark.parametrize("d", [16, 24])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference(case: str, group: int, d: int) -> None:
    c = make_case(CASES[case], hkv=2, group=group, seed=group * 7 + d, d=d)
    expected = paged_attention_ref(
        c["q"], c["k_pool"], c["v_pool"], c["req_to_token"], c["req_pool_indices"], c["seq_lens"],
        c["extend_lens"], c["scale"],
    )
    torch.testing.assert_close(run_triton(c), expected, atol=2e-5, rtol=1e-4)


def test_triton_rejects_strided_head_dim() -> None:
    c = make_case([(5, 1)], hkv=1, group=2, seed=0)
    c["q"] = c["q"].transpose(1, 2).contiguous().transpose(1, 2)  # head_dim no longer unit-stride
    with pytest.raises(ValueError, match="unit-stride"):
        run_triton(c)
