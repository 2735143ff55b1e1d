"""NVFP4 numerics, emulated: FP4 E2M1 values in blocks of 16 with FP8 E4M3 block scales.

A tensor ``x`` whose last dimension d is a multiple of 16 (keys or values: the head dim d_h) is
cut into blocks of ``BLOCK = 16`` consecutive entries along it. With a float32 global scale
s_g (per tensor; here per cache layer, per k/v and per kv head) each block b gets

    s_b = E4M3(amax_b / 6 / s_g)            the FP8 block scale (saturating at 448)
    q_i = E2M1(x_i / (s_b · s_g))           round to nearest, ties to even, saturating at ±6
    x̂_i = q_i · s_b · s_g                   what a kernel reads

as NVIDIA's NVFP4 quantize kernels compute it. E2M1 holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. A block
whose scale ratio amax_b / 6 / s_g exceeds 448 *overflows* (its scale saturates and its largest
entries are clipped); one whose ratio is below E4M3's smallest normal 2^-6 is *subnormal* (its
scale keeps fewer than 4 significant bits, or rounds to 0 and the block reads as zeros).

``global_scale(amax)`` gives s_g ≥ amax / (6 · 448): with the certified bound B ≥ |x_i| of
``WeightKVScales`` as ``amax`` no block can overflow for any input, and a block goes subnormal
only if its own amax is below B / (6 · 448) · 6 · 2^-6 = B / 28672.

Storage (``pack``): per row of d entries, d/2 bytes of E2M1 codes (two per byte, the even entry
in the low nibble) followed by d/16 bytes of E4M3 block-scale bits: 4.5 bits per entry.

Every function is elementwise/reduction torch code, traceable by torch.compile (no ``.item()``,
no branching on values)::

    >>> x = torch.randn(2, 4, 32)
    >>> g = global_scale(x.abs().amax())
    >>> codes, scale_bits = quantize(x, g)          # (2, 4, 32), (2, 4, 2) uint8
    >>> x_hat = dequantize(codes, scale_bits, g)    # float32 (2, 4, 32)
    >>> torch.equal(unpack(pack(codes, scale_bits), 32)[0], codes)
    True
"""
from __future__ import annotations

import torch

from geoscale_fx.core.bounds import round_up_f32
from geoscale_fx.core.fp8 import NVFP4, saturating_cast

__all__ = ["NVFP4", "BLOCK", "E2M1_MAX", "E4M3_MAX", "E4M3_MIN_NORMAL", "global_scale",
           "round_e2m1", "block_scale_ratio", "scale_range_counts", "quantize", "dequantize",
           "fake_quantize", "pack", "unpack", "packed_width"]

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6

# s_g is rounded up with a few float32 ulps to spare, so that amax/6/s_g evaluated in float32
# (two roundings, each ≤ 2^-24 relative) stays ≤ 448 for amax at the bound.
_MARGIN = 1.0 + 2.0 ** -20


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 s_g ≥ amax / (6 · 448) (any shape; amax ≥ 0, float64 for a certified bound):
    every block of a tensor with |x_i| ≤ amax then has a block scale ≤ 448. Floored at the
    smallest normal float32 so that amax = 0 gives a finite, positive divisor."""
    return round_up_f32(amax.detach().double() * (_MARGIN / (E2M1_MAX * E4M3_MAX)))


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest E2M1 value (ties to the even code), saturating at ±6; NaN
    stays NaN. The grid's spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6], and an even
    multiple of the spacing is an even code, so ``torch.round`` (half to even) on x / spacing
    is ties-to-even."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / step) * step, x)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if d % BLOCK:
        raise ValueError(f"NVFP4: the last dimension ({d}) must be a multiple of {BLOCK}")
    return x.reshape(*x.shape[:-1], d // BLOCK, BLOCK)           # (..., d/16, 16)


def block_scale_ratio(x: torch.Tensor, s_g: torch.Tensor) -> torch.Tensor:
    """float32 (..., d/16): amax_b / 6 / s_g, the block scale before its E4M3 cast.
    ``s_g`` broadcasts against (..., d/16)."""
    amax = _blocks(x.float()).abs().amax(dim=-1)                  # (..., d/16)
    return amax / E2M1_MAX / s_g


def scale_range_counts(ratio: torch.Tensor) -> torch.Tensor:
    """int64 (2,): block scales that overflow E4M3 (ratio > 448) and that are subnormal
    (0 < ratio < 2^-6; an all-zero block's scale 0 is exact and counts as neither)."""
    overflow = (ratio > E4M3_MAX).sum()
    subnormal = ((ratio > 0) & (ratio < E4M3_MIN_NORMAL)).sum()
    return torch.stack([overflow, subnormal])


def _e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit codes (sign bit 3, magnitude index 0..7) of E2M1 values ``q``."""
    m = q.abs()
    index = torch.where(m < 2.0, 2.0 * m, torch.where(m <= 4.0, m + 2.0, 7.0))
    sign = torch.signbit(q).to(torch.uint8) << 3
    return index.to(torch.uint8) | sign


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 E2M1 codes: exponent e = bits 2..1, mantissa m = bit 0;
    0.5·m if e = 0 (subnormal), else 2^(e−1)·(1 + m/2)."""
    c = codes.to(torch.int32)
    e, m = ((c >> 1) & 3).float(), (c & 1).float()
    magnitude = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1.0) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def quantize(x: torch.Tensor, s_g: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale_bits)``: uint8 (..., d) E2M1 codes of x and uint8 (..., d/16) bits of
    the E4M3 block scales s_b (a block whose scale rounds to 0 reads as zeros)."""
    ratio = block_scale_ratio(x, s_g)                                # (..., d/16)
    scale = saturating_cast(ratio, "e4m3")          # ratio ≥ 0: only 448 binds
    divisor = (scale.float() * s_g).unsqueeze(-1)                    # (..., d/16, 1)
    scaled = torch.where(divisor > 0, _blocks(x.float()) / divisor, 0.0)
    codes = _e2m1_codes(round_e2m1(scaled)).reshape(x.shape)
    return codes, scale.view(torch.uint8)


def dequantize(codes: torch.Tensor, scale_bits: torch.Tensor, s_g: torch.Tensor
               ) -> torch.Tensor:
    """float32 (..., d): q_i · s_b · s_g from ``quantize``'s output."""
    q = _blocks(_e2m1_values(codes))                                   # (..., d/16, 16)
    scale = scale_bits.view(torch.float8_e4m3fn).float() * s_g
    return (q * scale.unsqueeze(-1)).reshape(codes.shape)


def fake_quantize(x: torch.Tensor, s_g: torch.Tensor) -> torch.Tensor:
    """x rounded through NVFP4 and back (float32, x's shape)."""
    return dequantize(*quantize(x, s_g), s_g)


def packed_width(d: int) -> int:
    """Bytes per row of d entries: d/2 of codes and d/16 of block scales."""
    return d // 2 + d // BLOCK


def pack(codes: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """uint8 (..., d/2 + d/16): two codes per byte (even entry low), then the scale bits."""
    pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)                 # (..., d/2)
    return torch.cat([pairs, scale_bits], dim=-1)


def unpack(packed: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes (..., d), scale_bits (..., d/16))`` from ``pack``'s output."""
    pairs, scale_bits = packed[..., : d // 2], packed[..., d // 2:]
    codes = torch.stack([pairs & 15, pairs >> 4], dim=-1)              # (..., d/2, 2)
    return codes.reshape(*packed.shape[:-1], d), scale_bits
