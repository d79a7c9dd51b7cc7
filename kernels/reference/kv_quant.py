"""--kv-cache-dtype q8_0 in plain torch: K/V stored 8 bits per element in llama.cpp's block_q8_0 layout, and
read back as float32. The torch path's (any device) and what the C kernel (kernels/csrc/kv_types.h) is held
to byte for byte.

A q8_0 pool is a uint8 tensor [slots, kv_heads, head_dim / 32 * 34]: each head's row is head_dim / 32 blocks
of (float16 scale d, little-endian, then 32 int8 q), and element j of a block reads back as q[j] * d. A uint8
pool means q8_0 (the pools' other elements are floats): its rows move between slots, tiers and threads as
plain bytes, so everything that copies slots along dim 0 needs no change.

Quantizing a block of 32 float32 values x, exactly (every step is one IEEE float32 operation, so torch and
the C code give the same bytes on any device):
- amax = max |x|; d = float16(amax / 127), rounded to nearest even and, past the largest half, saturated
  to 65504 (values past 127 * 65504 clamp to it instead of turning infinite);
- q = round(x * (1 / d)), half away from zero (C's roundf), clamped to [-127, 127]; 1 / d is taken of the
  stored (float16) scale, so each value gets the nearest point of the grid its block reads back on (ggml's
  reference divides by the unrounded scale); d == 0 (a zero block, or amax below ~127 * 2^-25): every q 0;
- a block holding a NaN or an infinity stores a NaN scale (0x7e00) and zeros: it reads back as NaN, all 32
  elements, so a non-finite K/V poisons attention as it would in a float pool.
Reading back, q * d is exact in float32 (8 bits times 11), so a q8_0 pool attends with the very bits of a
float32 pool holding its values. Small blocks (amax below ~0.0078) get a subnormal scale and fewer
significant bits, as in llama.cpp.
"""

from __future__ import annotations

import torch

QK = 32  # elements per block
BLOCK_BYTES = 2 + QK  # the float16 scale, then the 32 int8 values
Q8_0 = torch.uint8  # the pool dtype that stands for q8_0 (KVCache, the kernels' KV_TYPES)
F16_MAX = 65504.0
NAN_F16_BITS = 0x7E00


def is_q8_0(dtype: torch.dtype) -> bool:
    return dtype == Q8_0


def pool_width(dtype: torch.dtype, head_dim: int) -> int:
    """A pool row's last dimension for one KV head of head_dim elements (in the pool tensor's elements)."""
    if not is_q8_0(dtype):
        return head_dim
    if head_dim % QK:
        raise ValueError(f"--kv-cache-dtype q8_0 needs a head size that is a multiple of {QK}: this model's "
                         f"head_dim is {head_dim}")
    return head_dim // QK * BLOCK_BYTES


def dtype_name(dtype: torch.dtype) -> str:
    """The --kv-cache-dtype value that makes pools of `dtype`: float16, q8_0, ..."""
    return "q8_0" if is_q8_0(dtype) else str(dtype).removeprefix("torch.")


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """C's roundf, exactly: torch.round takes ties to even, and floor(|y| + 0.5) rounds 0.49999997 up."""
    t = torch.trunc(y)
    return torch.where((y - t).abs() >= 0.5, t + torch.sign(y), t)  # y - t: exact (y's fraction)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32, any float dtype; computed in float32) -> uint8 [..., n / 32 * 34]."""
    n = x.shape[-1]
    if n % QK:
        raise ValueError(f"q8_0 quantizes rows of whole blocks of {QK} elements, not {n}")
    blocks = x.float().reshape(*x.shape[:-1], n // QK, QK)
    amax = blocks.abs().amax(-1)  # NaN if the block holds one
    finite = torch.isfinite(amax)
    d = (amax / 127).to(torch.float16).clamp(max=F16_MAX)  # NaN stays NaN
    d32 = d.float()
    inv = torch.where(finite & (d32 > 0), 1.0 / d32, torch.zeros_like(d32))
    q = _round_half_away(blocks * inv[..., None]).clamp(-127, 127)
    q = torch.where(finite[..., None], q, torch.zeros_like(q))  # (NaN * 0 is NaN: masked, not multiplied)
    d_bits = torch.where(finite, d.view(torch.int16), torch.full_like(d.view(torch.int16), NAN_F16_BITS))
    out = torch.cat([d_bits.view(torch.uint8).view(*d.shape, 2), q.to(torch.int8).view(torch.uint8)], -1)
    return out.view(*x.shape[:-1], n // QK * BLOCK_BYTES)


def dequantize_q8_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., m * 34] -> [..., m * 32] in `dtype` (computed in float32, exactly)."""
    w = b.shape[-1]
    if b.dtype != Q8_0 or w % BLOCK_BYTES:
        raise ValueError(f"q8_0 rows are uint8 blocks of {BLOCK_BYTES} bytes, not {b.dtype} rows of {w}")
    blocks = b.reshape(*b.shape[:-1], w // BLOCK_BYTES, BLOCK_BYTES)
    # The scale's two bytes as one float16: copied out first (a view of bytes at odd offsets cannot be
    # reinterpreted in place).
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].view(torch.int8).float()
    return (q * d).reshape(*b.shape[:-1], w // BLOCK_BYTES * QK).to(dtype)


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] as a pool of `dtype` stores it: rounded to a float dtype, or quantized to q8_0 blocks."""
    return quantize_q8_0(x) if is_q8_0(dtype) else x.to(dtype)


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a pool (any element) as `dtype`: q8_0 blocks dequantized, floats converted."""
    return dequantize_q8_0(rows, dtype) if is_q8_0(rows.dtype) else rows.to(dtype)
