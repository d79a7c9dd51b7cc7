"""Small host lists onto the device the way a step must: one host buffer, one copy, never a wait."""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch


def to_device(arrays: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """The arrays as int64 tensors on `device`, views of one buffer: one host tensor and one H2D copy
    (pinned, non-blocking on CUDA, so the host never waits for it) per call, not one per array."""
    buf = array("q")
    for a in arrays:
        buf.extend(a)  # array('q') fills ~2x faster than torch.tensor(list) for prefill-sized arrays
    host = torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)
    if device.type == "cuda":
        # The caching host allocator keeps the pinned block until the copy is done.
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    return list(torch.split(dev, [len(a) for a in arrays]))
