"""FP8 formats, the one saturating cast, the quantize–dequantize of scaled logits, and
overflow accounting.

On torch 2.13 ``.to(torch.float8_e4m3fn)`` saturates (1000 → 448, inf → 448) but
``.to(torch.float8_e5m2)`` does not (61440 and above → inf). ``saturating_cast`` clamps to
±R_max first, so both formats saturate (as FP8 kernels with saturating casts do) and an
overflow never shows up as a NaN: it is counted explicitly as ``|S / scale| > R_max``. Every
cast to FP8 in the package (logits, the FP8 KV cache, FA3's operands, NVFP4's E4M3 block
scales) goes through it.

The format names live here too: ``FP8_DTYPES``, and ``KV_CACHE_FORMATS`` (``kv_cache=``
value → storage format, ``NVFP4`` included)::

    >>> saturating_cast(torch.tensor([1000.0, -0.0, 1.0625]), "e4m3").float()
    tensor([448.,  -0.,   1.])
"""
from __future__ import annotations

import torch

from geoscale_fx.core.bounds import fp8_max

__all__ = ["FP8_DTYPES", "NVFP4", "KV_CACHE_FORMATS", "kv_format", "fp8_dtype",
           "saturating_cast", "quantize_dequantize", "fake_quantize_logits", "scaled_abs_max",
           "overflowed"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

#: the NVFP4 storage format's name (its numerics: ``geoscale_fx.core.nvfp4``)
NVFP4 = "nvfp4"

#: ``kv_cache=`` value -> storage format of the KV cache (an FP8 format, or NVFP4)
KV_CACHE_FORMATS = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2",
                    "nvfp4": NVFP4}


def kv_format(kv_cache: str) -> str:
    """The storage format of ``kv_cache=`` (a ValueError listing the allowed values)."""
    try:
        return KV_CACHE_FORMATS[kv_cache]
    except KeyError:
        raise ValueError(f"kv_cache={kv_cache!r}; allowed values: "
                         f"{sorted(KV_CACHE_FORMATS)} (or None for the model's own cache)"
                         ) from None


def fp8_dtype(fmt: str) -> torch.dtype:
    try:
        return FP8_DTYPES[fmt]
    except KeyError:
        raise ValueError(f"fmt must be one of {sorted(FP8_DTYPES)}, got {fmt!r}") from None


def saturating_cast(scaled: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """``Q(scaled)``: already-scaled values cast to FP8 ``fmt`` (round to nearest, ties to
    even), saturating at ±R_max: |x| > R_max (±inf included) becomes ±R_max, NaN stays NaN,
    −0 stays −0. Same shape as ``scaled``, dtype ``fp8_dtype(fmt)``. Clamped before the cast:
    torch's own e5m2 cast overflows to ±inf."""
    dtype = fp8_dtype(fmt)
    limit = fp8_max(fmt)
    return scaled.clamp(-limit, limit).to(dtype)


def quantize_dequantize(scaled: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Round already-scaled values to FP8 and back, saturating at ±R_max (NaN stays NaN)."""
    return saturating_cast(scaled, fmt).to(scaled.dtype)


def fake_quantize_logits(logits: torch.Tensor, divisor: torch.Tensor,
                         fmt: str = "e4m3") -> torch.Tensor:
    """``S ↦ Q(S / scale) · scale`` with a straight-through gradient.

    ``divisor`` broadcasts against ``logits`` (one scale per head: shape ``(H, 1, 1)``).
    The forward value is the FP8 round trip; the backward pass treats the quantizer as the
    identity (the usual straight-through estimator for fake quantization). Written as
    ``rounded + (S − S.detach())`` so that a huge ``S`` (1e10) does not cancel to 0.
    """
    divisor = divisor.detach().to(logits.dtype)
    rounded = quantize_dequantize(logits.detach() / divisor, fmt) * divisor
    return rounded + (logits - logits.detach())


def scaled_abs_max(logits: torch.Tensor, divisor: torch.Tensor, reduce_dims) -> torch.Tensor:
    """``max |S| / scale`` over ``reduce_dims`` (the scaled logit FP8 must represent)."""
    return (logits.detach().abs() / divisor.to(logits.dtype)).amax(dim=reduce_dims)


#: relative slack on R_max: a scale that maps max|S| exactly onto R_max (current scaling)
#: lands a few float32 ulps above it, which is rounding, not an overflow
OVERFLOW_RTOL = 1e-5


def overflowed(scaled_max: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Boolean: the scaled logit exceeded the format's range (the cast saturated)."""
    return scaled_max > fp8_max(fmt) * (1.0 + OVERFLOW_RTOL)
