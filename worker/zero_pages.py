"""Big zero-filled CPU tensors that cost nothing until they are written.

torch.zeros writes every byte: ~0.5 s of a 1B model's start for its KV pools. An anonymous mapping is the
kernel's zero pages until first written, so the pools are zero (attention's padding reads slot 0; a NaN
left in uninitialised memory would poison a masked score) without the pass. Huge pages where the kernel
gives them: one fault per 2 MiB as the pools fill, and fewer TLB misses when attention walks them.
"""
from __future__ import annotations

import contextlib
import math
import mmap

import torch

MIN_BYTES = 1 << 20  # below this torch.zeros is as cheap, and a mapping per small tensor wastes a page


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device); on CPU, when big, backed by an anonymous mapping."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mm = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small pages
            mm.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer holds a reference to the mapping: it lives as long as the tensor
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)
