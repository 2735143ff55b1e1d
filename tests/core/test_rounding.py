"""core.rounding: the envelope of a round-to-nearest cast, against torch's own casts."""
from __future__ import annotations

import doctest

import pytest
import torch

from geoscale_fx.core.rounding import (
    dtype_by_name, subnormal_half_spacing, unit_roundoff,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _samples(dtype: torch.dtype) -> torch.Tensor:
    """Log-uniform magnitudes over the whole range (subnormals included), both signs, and
    every midpoint between consecutive representable values, nudged both ways."""
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    low = float(info.smallest_normal) * float(info.eps) / 4
    logs = torch.rand(200_000, generator=gen, dtype=torch.float64)
    mags = torch.exp(logs * (torch.log(torch.tensor(float(info.max))) - torch.log(
        torch.tensor(low))) + torch.log(torch.tensor(low)))
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mid * (1 - 1e-6), mid * (1 + 1e-6), mid])
    values = torch.cat([mags, near]).clamp(max=float(info.max))
    return torch.cat([values, -values]).float()


@pytest.mark.parametrize("dtype", FP8)
def test_rounding_error_is_within_u_relative_plus_half_a_subnormal(dtype):
    y = _samples(dtype)
    q = y.to(dtype).double()
    err = (q - y.double()).abs()
    u, h = unit_roundoff(dtype), subnormal_half_spacing(dtype)
    assert bool((err <= u * y.double().abs() + h).all())
    assert bool((q * y.double() >= 0).all())                       # the sign is kept
    normal = y.double().abs() >= float(torch.finfo(dtype).smallest_normal)
    # tight: rounding reaches u/(1 + u) relative (a midpoint just above a power of two)
    # in the normal range, and h below it
    assert float((err[normal] / y.double().abs()[normal]).max()) > 0.999 * u / (1 + u)
    assert float(err[~normal].max()) > 0.99 * h


def test_the_constants_of_the_formats():
    assert (unit_roundoff(torch.float8_e4m3fn), subnormal_half_spacing(torch.float8_e4m3fn)) \
        == (2.0 ** -4, 2.0 ** -10)
    assert (unit_roundoff(torch.float8_e5m2), subnormal_half_spacing(torch.float8_e5m2)) \
        == (2.0 ** -3, 2.0 ** -17)
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert dtype_by_name("float8_e4m3fn") is torch.float8_e4m3fn
    for bad in ("int8", "nope"):
        with pytest.raises(ValueError, match="not a floating-point torch dtype"):
            dtype_by_name(bad)


def test_docstring_example_runs():
    from geoscale_fx.core import rounding

    assert doctest.testmod(rounding).failed == 0
