"""The plain reference of the int8-activation product (kernels/csrc/quant_int8.h, --cpu-int8-activations):
exactly the kernel's arithmetic in numpy, what the tests hold every path of the kernel to, bit for bit.

Activations per row and 32-block: d = max|x| / 127, q = round-half-even(clamp(x / d, -127, 127)) (0 where
d = 0; d = NaN and q = 0 for a block with an infinite or NaN input), the sums of q over each 16 inputs and
sd = d * (s0 + s1). Each output is one float32 chain over the blocks in order: per scale group
fma(D * d, sum((qw - offset) * q), acc), then fma(M, sd, acc) for the types with a minimum.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.kernels.native.quant_pack import KBLK, OFFSETS, QuantRows, QuantWeight, unpack


def quantize_activations(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [M, K] -> q int8 [M, K], d float32 [M, K / 32], s int64 [M, K / 32, 2], sd float32 [M, K /
    32]."""
    xb = x.detach().float().numpy().reshape(x.shape[0], -1, KBLK)
    finite = np.isfinite(xb).all(-1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.where(finite, np.abs(np.where(np.isfinite(xb), xb, 0)).max(-1), 0).astype(np.float32)
        d = np.where(finite, amax / np.float32(127), np.float32(np.nan)).astype(np.float32)
        t = np.clip(xb / d[..., None], np.float32(-127), np.float32(127))
        q = np.where((d > 0)[..., None], np.rint(t), 0).astype(np.int8)
    s = q.astype(np.int64).reshape(*q.shape[:2], 2, 16).sum(-1)
    sd = (d * s.sum(-1).astype(np.float32)).astype(np.float32)
    return q.reshape(x.shape[0], -1), d, s, sd


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once: a * b is exact in float64, the sum with c is rounded to odd in float64
    (TwoSum's error decides the last bit), which then rounds to float32 as the exact sum would."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        t = s - p
        err = (p - (s - t)) + (c - t)
        even = (s.view(np.int64) & 1) == 0
        s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def _columns(a: np.ndarray, n: int) -> np.ndarray:
    """[panels, kb, groups, 16] -> [n, kb, groups]: per output column."""
    return a.transpose(0, 3, 1, 2).reshape(-1, *a.shape[1:3])[:n]


def int8_linear_ref(x: torch.Tensor, w: QuantWeight | QuantRows) -> torch.Tensor:
    """x float32 [M, K] -> [M, out] float32, the int8-activation product as the kernel computes it."""
    if isinstance(w, QuantRows):
        return torch.cat([int8_linear_ref(x, p) for p in w.parts], dim=1)
    qx, dx, sx, sd = quantize_activations(x)
    q, d, m = unpack(w)
    n, kb, groups = w.out_features, q.shape[1], d.shape[2]
    qw = q.transpose(0, 3, 1, 2).reshape(-1, kb * KBLK)[:n].astype(np.int64) - OFFSETS.get(w.qtype, 0)
    d, m = _columns(d, n), None if m is None else _columns(m, n)[..., 0]
    acc = np.zeros((x.shape[0], n), np.float32)
    gk = KBLK // groups
    for b in range(kb):
        for g in range(groups):
            ks = slice(b * KBLK + g * gk, b * KBLK + (g + 1) * gk)
            isum = qx[:, ks].astype(np.int64) @ qw[:, ks].T  # exact
            acc = fma32(d[None, :, b, g] * dx[:, b, None], isum.astype(np.float32), acc)
        if m is not None:
            acc = fma32(
                np.broadcast_to(m[None, :, b], acc.shape), np.broadcast_to(sd[:, b, None], acc.shape), acc
            )
    return torch.from_numpy(acc)
