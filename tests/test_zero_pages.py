"""worker/zero_pages.py: the KV pools' zero-filled memory, mapped rather than written."""
from __future__ import annotations

import gc

import pytest
import torch

from tandem.worker.kv_cache import KVCache
from tandem.worker.zero_pages import MIN_BYTES, zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
@pytest.mark.parametrize("shape", [(3, 5), (MIN_BYTES // 8, 2, 4), (0, 4)])
def test_zeroed_is_torch_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    z = zeroed(shape, dtype)
    ref = torch.zeros(shape, dtype=dtype)
    assert z.shape == ref.shape and z.dtype == dtype and z.is_contiguous() and torch.equal(z, ref)
    if z.numel():
        z.view(-1)[-1] = 7  # writable to its last byte
        assert z.view(-1)[-1].item() == 7 and z.view(-1)[:-1].eq(0).all()


def test_the_mapping_lives_as_long_as_the_tensor() -> None:
    """Only the tensor is kept: the mapping under it must not be unmapped (a use after it would crash)."""
    views = [zeroed((MIN_BYTES,), torch.uint8)[1:] for _ in range(4)]
    gc.collect()
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert [int(v.sum()) for v in views] == [(i + 1) * (MIN_BYTES - 1) for i in range(4)]


def test_kv_pools_start_zero_and_take_writes() -> None:
    kv = KVCache(2, 4096, 2, 64, torch.float32, "cpu", max_reqs=8, max_context=256, host_slots=1024)
    for pool in (*kv.k, *kv.v, *kv.host_k, *kv.host_v, kv.req_to_token):
        assert not pool.any()
    loc = torch.tensor([5, 4095])
    k, v = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    kv.write(1, loc, k, v)
    assert torch.equal(kv.k[1][loc], k) and torch.equal(kv.v[1][loc], v) and not kv.k[0].any()
