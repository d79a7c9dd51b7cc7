"""The worker's host KV pool on CPU: copies keep the KV exactly, and a step saves before it loads."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.reference.kv_quant import Q8_0
from tandem.protocol.messages import KVCopies
from tandem.worker.kv_cache import KVCache, host_runs


def test_host_runs_split_on_gaps() -> None:
    assert host_runs([4, 5, 6, 9, 10, 2]) == [(0, 3, 4), (3, 5, 9), (5, 6, 2)]
    assert host_runs([]) == []


# --kv-cache-dtype (uint8: q8_0 blocks, whose slot rows are bytes)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, Q8_0])
def test_copies_round_trip_and_save_before_load(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    kv = KVCache(2, 64, 2, 32, dtype, "cpu", max_reqs=2, max_context=8, host_slots=32)
    assert all(h.dtype == dtype and h.shape[1:] == kv.k[0].shape[1:] for h in kv.host_k + kv.host_v)
    for layer in kv.k + kv.v:  # the host tier holds the same elements
        layer.copy_(torch.randn(layer.shape) if dtype != Q8_0 else torch.randint(0, 256, layer.shape))
    a = [layer[10:20].clone() for layer in kv.k + kv.v]
    b = [layer[30:35].clone() for layer in kv.k + kv.v]
    kv.copy(KVCopies(to_host_src=list(range(30, 35)), to_host_dst=[7, 8, 9, 1, 2]))
    # One step: slots 10..19 go to the host and 10..14 get b back from it; the save must come first.
    kv.copy(KVCopies(to_host_src=list(range(10, 20)), to_host_dst=list(range(20, 30)),
                     to_device_src=[7, 8, 9, 1, 2], to_device_dst=list(range(10, 15))))
    kv.copy(KVCopies(to_device_src=list(range(20, 30)), to_device_dst=list(range(40, 50))))
    for want_a, want_b, layer in zip(a, b, kv.k + kv.v):
        assert torch.equal(layer[40:50], want_a)
        assert torch.equal(layer[10:15], want_b)


def test_copies_without_a_host_pool_are_an_error() -> None:
    kv = KVCache(1, 16, 1, 4, torch.float32, "cpu", max_reqs=1, max_context=4)
    with pytest.raises(RuntimeError, match="host-kv-tokens"):
        kv.copy(KVCopies(to_host_src=[1], to_host_dst=[1]))
