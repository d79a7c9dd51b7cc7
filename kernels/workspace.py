"""Persistent scratch buffers shared by the CPU attention paths (the torch reference's gathered K/V, the C
kernel's scores).

A fresh multi-MB tensor per call comes from mmap and is page-faulted in on every call, which on CPU costs
as much as the gather itself; reusing one buffer (grown on demand, never shrunk) halves it. Layers run one
after another, so one buffer per name serves all of them; the buffers are module-global, so calls must not
run concurrently from several threads.
"""

from __future__ import annotations

import math

import torch


class GatherWorkspace:
    """Named buffers, one per (name, dtype, device), handed out as views of the requested shape."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dtype, like.device)
        numel = math.prod(shape)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            # A normal (not inference-mode) tensor, so callers inside and outside inference_mode can share it.
            with torch.inference_mode(False):
                buf = torch.empty(int(numel * 1.25), dtype=like.dtype, device=like.device)
            self._bufs[key] = buf
        return buf[:numel].view(shape)


WORKSPACE = GatherWorkspace()
