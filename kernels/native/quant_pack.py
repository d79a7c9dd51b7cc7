"""GGUF weight blocks repacked into the layouts of kernels/csrc/quant_blocks.h, and the plain reference.

`pack_reference` reads a GGUF tensor's blocks into each weight's quantized value q and its scales and lays
them out in panels of 16 output columns: the scales as the file holds them (float16 d and m, the K-quants'
integer sub-block scales), then a plane of q's high bits for the 5- and 6-bit types and q's low nibbles.
`pack` writes the same bytes in C (kernels/csrc/quant_repack.c, many times faster: the repacking was most
of a quantized model's start) where it builds. `dequantize` is the reference the tests hold the kernel to:
from that layout, the float32 weight the kernel rebuilds, D * q + M with D and M as the kernel computes
them, which is gguf's own dequantization of the file exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kernels.native import quant_repack

PANEL, KBLK = quant_repack.PANEL, 32
# GGUF type name -> (the kernel's block kind, weights per GGUF block, bytes per GGUF block). The kinds are
# quant_blocks.h's enum.
GGUF_BLOCKS = {
    "Q4_1": (0, 32, 20),
    "Q8_0": (1, 32, 34),
    "Q4_K": (2, 256, 144),
    "Q4_0": (3, 32, 18),
    "Q5_0": (4, 32, 22),
    "Q5_1": (5, 32, 24),
    "Q5_K": (6, 256, 176),
    "Q6_K": (7, 256, 210),
}
# Float weights kept row-major [out, in] as the checkpoint holds them, not repacked
# (kernels/csrc/dense_rows.h):
# the kinds after the blocks', for float32, bfloat16 and float16 layers of a float model on CPU.
DENSE_KINDS = {"F32": (8, torch.float32), "BF16": (9, torch.bfloat16), "F16": (10, torch.float16)}
_NAMES = {kind: name for name, (kind, _, _) in GGUF_BLOCKS.items()} | {
    k: n for n, (k, _) in DENSE_KINDS.items()
}
_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
_HIGH_BITS = {"Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 2}  # bits of q above its low nibble
OFFSETS = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}  # gguf's d * (q - offset): M = -offset * D
_WITH_M = ("Q4_1", "Q5_1")  # d * q + m, m stored


@dataclass(frozen=True)
class QuantWeight:
    """A [out_features, in_features] weight in the kernel's layout (quant_blocks.h)."""

    # uint8 [panels, K / super-block inputs, super-block bytes]; a dense kind: [out, in] float
    data: torch.Tensor
    kind: int  # GGUF_BLOCKS' kind
    out_features: int
    in_features: int

    @property
    def qtype(self) -> str:
        return _NAMES[self.kind]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def dense(self) -> bool:
        """A float weight kept row-major (DENSE_KINDS), not blocks."""
        return self.qtype in DENSE_KINDS


def dense(weight: torch.Tensor) -> QuantWeight:
    """A float32, bfloat16 or float16 [out, in] CPU weight for the kernel as it is (made contiguous, no copy
    when it already is: the same tensor may serve torch's products too)."""
    for kind, dtype in DENSE_KINDS.values():
        if weight.dtype == dtype:
            if weight.dim() != 2 or weight.device.type != "cpu":
                raise ValueError(
                    f"a dense weight is a 2-d CPU tensor, got {tuple(weight.shape)} on {weight.device}"
                )
            return QuantWeight(weight.contiguous(), kind, weight.shape[0], weight.shape[1])
    raise ValueError(f"no dense CPU kernel for {weight.dtype}; supported: float32, bfloat16, float16")


@dataclass(frozen=True)
class QuantRows:
    """A weight stacked along its output rows from parts of different GGUF types (a fused q/k/v projection
    whose v is Q6_K and q, k Q4_K, as in llama.cpp's Q4_K_M files): each part in its own kind, written to
    its own columns of the one output."""

    parts: tuple[QuantWeight, ...]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, as uint16 bit patterns [..., blocks]."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.uint16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's [..., 16] bytes of 32 nibbles -> q [..., 32]: the low nibbles are the first 16 weights."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(words: np.ndarray, count: int, width: int = 1) -> np.ndarray:
    """[..., w] -> [..., count, w]: field i (`width` bits at bit i * width) of every element."""
    shifts = (np.arange(count, dtype=words.dtype) * width)[:, None]
    return (words[..., None, :] >> shifts) & ((1 << width) - 1)


def _read(raw: np.ndarray, qtype: str, n: int, kb: int) -> dict[str, np.ndarray]:
    """A GGUF tensor's fields: q [n, kb, 32] (uint8 values, int8 bytes for Q8_0) and its scales: d (and m)
    [n, kb] as float16 bit patterns; for the K-quants d (and dmin) [n, super-blocks] and the integer scales
    sc (and mn) [n, super-blocks, 8 sub-blocks] (Q6_K: [n, super-blocks, 16], int8)."""
    block = GGUF_BLOCKS[qtype][2]
    if qtype in _K_QUANTS:
        sup = raw.reshape(n, kb // 8, block)
        if qtype == "Q6_K":
            ql = sup[..., :128].reshape(n, -1, 2, 64)  # per 128 weights: 64 bytes, low then high nibbles
            low = np.stack([ql & 15, ql >> 4], axis=3).reshape(n, -1, 256)
            high = _bits(sup[..., 128:192].reshape(n, -1, 2, 32), 4, 2).reshape(n, -1, 256)
            q = (low | high << 4).reshape(n, kb, 32)
            return {"q": q, "d": _halves(sup, 208), "sc": sup[..., 192:208].view(np.int8)}
        import gguf

        at = 16 if qtype == "Q4_K" else 48
        qs = sup[..., at : at + 128].reshape(n, -1, 4, 1, 32)  # sub-blocks 2j (low) and 2j + 1 (high)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if qtype == "Q5_K":  # bit s of byte i: sub-block s's weight i
            q = q | _bits(sup[..., 16:48], 8) << 4
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(sup[..., 4:16]).reshape(-1, 12))
        return {"q": q.reshape(n, kb, 32), "d": _halves(sup, 0), "dmin": _halves(sup, 2),
                "sc": sc.reshape(n, -1, 8), "mn": mn.reshape(n, -1, 8)}
    blocks = raw.reshape(n, kb, block)
    fields = {"d": _halves(blocks, 0)}
    if qtype == "Q8_0":
        fields["q"] = blocks[..., 2:]
        return fields
    at = 4 if qtype in _WITH_M else 2
    if qtype in _WITH_M:
        fields["m"] = _halves(blocks, 2)
    q = _nibbles(blocks[..., at + 4 * (qtype in _HIGH_BITS) :])
    if qtype in _HIGH_BITS:  # a little-endian 32-bit word: bit i is weight i's fifth bit
        qh = np.ascontiguousarray(blocks[..., at : at + 4]).view("<u4")
        q = q | (_bits(qh, 32)[..., 0].astype(np.uint8) << 4)
    fields["q"] = q
    return fields


def _check(raw: np.ndarray, qtype: str, in_features: int) -> int:
    """pack's checks of a type and shape; the kind."""
    if qtype not in GGUF_BLOCKS:
        raise ValueError(f"no CPU kernel for GGUF type {qtype}; supported: {', '.join(GGUF_BLOCKS)}")
    kind, elems, block = GGUF_BLOCKS[qtype]
    if (
        in_features % elems
        or raw.ndim != 2
        or raw.dtype != np.uint8
        or raw.shape[1] != in_features // elems * block
    ):
        raise ValueError(f"{qtype} weight of {in_features} inputs: expected uint8 rows of "
                         f"{in_features // elems * block} bytes, got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[0] == 0:  # no panel to write (numpy's reshapes would fail on it, not C's)
        raise ValueError(f"{qtype} weight of {in_features} inputs: no rows")
    return kind


def _not_finite(qtype: str) -> ValueError:
    # gguf's d * (q - offset) is +-inf where the kernel's D * q + M (M = -offset * D) is inf - inf
    return ValueError(f"{qtype} weight with an infinite or NaN scale: not repacked")


def pack(raw: np.ndarray | Sequence[np.ndarray], qtype: str, in_features: int) -> QuantWeight:
    """raw: a GGUF tensor's blocks as uint8 [out_features, in_features / block weights * block bytes] (gguf's
    reader gives this shape; rows and whole blocks may be sliced off first), or parts of one weight whose rows
    follow each other, packed as their concatenation. Raises ValueError for a type or shape the kernel does
    not take. Repacked in C (quant_repack.c) where it builds, else by pack_reference: the same bytes."""
    parts = [raw] if isinstance(raw, np.ndarray) else list(raw)
    kind = [_check(p, qtype, in_features) for p in parts][0]
    if not quant_repack.available():
        return pack_reference(parts[0] if len(parts) == 1 else np.concatenate(parts), qtype, in_features)
    data = quant_repack.repack(parts, kind, in_features)
    if data is None:
        raise _not_finite(qtype)
    return QuantWeight(data, kind, sum(p.shape[0] for p in parts), in_features)


def pack_reference(raw: np.ndarray, qtype: str, in_features: int) -> QuantWeight:
    """pack in numpy: the plain reference of the layout, and what runs without the C repacking."""
    kind = _check(raw, qtype, in_features)
    n, kb = raw.shape[0], in_features // KBLK
    f = _read(raw, qtype, n, kb)
    if qtype in OFFSETS and not np.isfinite(f["d"].view(np.float16)).all():
        raise _not_finite(qtype)
    panels = -(-n // PANEL)
    pad = panels * PANEL - n

    def by_panel(a: np.ndarray) -> np.ndarray:  # [n, ...] -> [panels, ..., 16], rows past n zero
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return np.moveaxis(a.reshape(panels, PANEL, *a.shape[1:]), 1, -1)

    def as_bytes(a: np.ndarray, groups: int) -> np.ndarray:  # [n, groups, ...] -> [panels, groups, bytes]
        return np.ascontiguousarray(by_panel(a)).view(np.uint8).reshape(panels, groups, -1)

    q = by_panel(f["q"])  # [panels, kb, 32, 16]
    if qtype == "Q8_0":
        quants = [q.reshape(panels, kb, 512)]
    else:
        quants = [((q[..., :8] & 15) | (q[..., 8:] << 4)).reshape(panels, kb, 256)]
        hb = _HIGH_BITS.get(qtype, 0)
        if hb:  # per k one 16- or 32-bit word: column c's high bits at bit c * hb; before the nibbles
            shifts = np.arange(PANEL, dtype=np.uint32) * hb
            words = ((q >> 4).astype(np.uint32) << shifts).sum(axis=-1, dtype=np.uint32)
            quants.insert(0, words.astype("<u2" if hb == 1 else "<u4").view(np.uint8).reshape(panels, kb, -1))
    quants = np.concatenate(quants, axis=-1)
    if qtype in _K_QUANTS:  # a super-block: its scales, then its 8 32-blocks' values
        sb = kb // 8
        names = ("d", "sc") if qtype == "Q6_K" else ("d", "dmin", "sc", "mn")
        parts = [*(as_bytes(f[name], sb) for name in names), quants.reshape(panels, sb, -1)]
    else:
        parts = [*(as_bytes(f[name], kb) for name in ("d", "m") if name in f), quants]
    data = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return QuantWeight(torch.from_numpy(data), kind, n, in_features)


def unpack(w: QuantWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """From the layout: q [panels, kb, 32 (k), 16 (column)] (uint8; int8 for Q8_0), D float32 [panels, kb,
    groups, 16] (2 scale groups of 16 inputs for Q6_K, else 1) and M float32 [panels, kb, 1, 16] for the types
    whose weights are D * q + M with M stored (Q4_1, Q5_1, Q4_K, Q5_K; None for the others, D * (q - offset)
    or, Q8_0, D * q), each computed as the kernel computes it."""
    qtype = w.qtype
    a = w.data.numpy()
    panels = a.shape[0]
    kb = w.in_features // KBLK
    subs = 8 if qtype in _K_QUANTS else 1
    hb = _HIGH_BITS.get(qtype, 0)
    qb = 512 if qtype == "Q8_0" else 256 + 64 * hb
    scales = a[..., : a.shape[-1] - subs * qb]
    quants = a[..., scales.shape[-1] :].reshape(panels, kb, qb)

    def halves(at: int) -> np.ndarray:  # 16 float16 at byte `at` of the scales: [panels, groups, 16] float32
        return np.ascontiguousarray(scales[..., at : at + 32]).view(np.float16).astype(np.float32)

    def per_sub(at: int, groups: int, dtype: type) -> np.ndarray:  # [panels, kb * groups / 8 ... , 16]
        s = np.ascontiguousarray(scales[..., at : at + groups * PANEL]).view(dtype)
        return s.reshape(panels, -1, PANEL).astype(np.float32)

    if qtype == "Q8_0":
        q = quants.view(np.int8).reshape(panels, kb, 32, 16)
    else:
        b = quants[..., 64 * hb :].reshape(panels, kb, 32, 8)
        q = np.concatenate([b & 15, b >> 4], axis=-1)  # [panels, kb, 32 (k), 16 (column)]
        if hb:
            words = (
                np.ascontiguousarray(quants[..., : 64 * hb])
                .view("<u2" if hb == 1 else "<u4")
                .astype(np.uint32)
            )
            q = q | (_bits(words, PANEL, hb).swapaxes(-1, -2) << 4).astype(np.uint8)
    d, m = halves(0), None
    if qtype == "Q6_K":  # d * sc per 16 inputs
        d = (d[:, :, None, :] * per_sub(32, 16, np.int8).reshape(panels, -1, 16, PANEL)).reshape(
            panels, kb, 2, 16
        )
    elif qtype in _K_QUANTS:
        sc, mn = per_sub(64, 8, np.uint8), per_sub(64 + 8 * PANEL, 8, np.uint8)
        d = (d[:, :, None, :] * sc.reshape(panels, -1, 8, PANEL)).reshape(panels, kb, 1, 16)
        m = -(halves(32)[:, :, None, :] * mn.reshape(panels, -1, 8, PANEL)).reshape(panels, kb, 1, 16)
    else:
        d = d[:, :, None, :]
    if qtype in _WITH_M:
        m = halves(32)[:, :, None, :]
    return q, d, m


def dequantize(w: QuantWeight | QuantRows) -> torch.Tensor:
    """The reference: the float32 [out, in] weight a packed one stands for, D * q + M with D and M computed
    as the kernel computes them from its layout (what gguf's dequantization of the file gives)."""
    if isinstance(w, QuantRows):
        return torch.cat([dequantize(p) for p in w.parts])
    if w.dense:
        return w.data.float()
    q, d, m = unpack(w)
    panels, kb = q.shape[:2]
    d = np.repeat(d, 32 // d.shape[2], axis=2)  # each scale over its inputs: [panels, kb, 32 (k), 16]
    if w.qtype in OFFSETS:
        m = d * np.float32(-OFFSETS[w.qtype])
    elif m is None:  # Q8_0
        m = np.float32(0)
    deq = d * q.astype(np.float32) + m  # d * q is exact: one rounding, the FMA's
    # [panels, kb, 32 (k), 16 (column)] -> [panels * 16, kb * 32]
    full = deq.transpose(0, 3, 1, 2).reshape(panels * PANEL, kb * KBLK)
    return torch.from_numpy(np.ascontiguousarray(full[: w.out_features]))
