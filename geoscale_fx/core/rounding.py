"""What a round-to-nearest cast to a floating-point format can change, from ``torch.finfo``.

A format with ``p`` significand bits (the implicit one included) rounds a value ``y`` in its
normal range to ``Q(y)`` with ``|Q(y) − y| ≤ 2^(e−p)`` where ``2^e ≤ |y|``, i.e.

    |Q(y) − y| ≤ u·|y|,        u = 2^−p = eps/2                       (unit roundoff)

and below the smallest normal ``2^e_min`` the spacing is the smallest subnormal
``2^(e_min+1−p)``, so ``|Q(y) − y| ≤ h = 2^(e_min−p)`` (half of it). Together, for any
``|y|`` up to the largest finite value: ``|Q(y) − y| ≤ u·|y| + h``, and ``Q(y)`` has the
sign of ``y`` (or is 0). For E4M3 (``p = 4``, ``e_min = −6``): ``u = 2⁻⁴``, ``h = 2⁻¹⁰``;
for E5M2: ``u = 2⁻³``, ``h = 2⁻¹⁷``; for bfloat16: ``u = 2⁻⁸``.

    >>> unit_roundoff(torch.float8_e4m3fn), subnormal_half_spacing(torch.float8_e4m3fn)
    (0.0625, 0.0009765625)
"""
from __future__ import annotations

import torch

__all__ = ["unit_roundoff", "subnormal_half_spacing", "F32_SLACK", "dtype_by_name"]

#: relative allowance for a few float32 roundings around a cast (each ≤ 2⁻²⁴): the scale's
#: own rounding, the product ``v·s`` and the dequantizing factor ``1/s``
F32_SLACK = 2.0 ** -20


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = 2^−p``: the relative error of rounding to nearest in the normal range."""
    return float(torch.finfo(dtype).eps) / 2.0


def subnormal_half_spacing(dtype: torch.dtype) -> float:
    """``h``: the absolute error of rounding to nearest below the smallest normal value."""
    info = torch.finfo(dtype)
    return float(info.smallest_normal) * float(info.eps) / 2.0


def dtype_by_name(name: str) -> torch.dtype:
    """``"float8_e4m3fn"`` -> ``torch.float8_e4m3fn`` (a ValueError for anything else)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name!r} is not a floating-point torch dtype")
    return dtype
