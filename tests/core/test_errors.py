"""core.errors: the one finiteness check against a count by ``math.isfinite`` on Python
floats, for every floating dtype, and the public error."""
from __future__ import annotations

import math

import pytest
import torch

import geoscale_fx
from geoscale_fx.core.errors import NonFiniteWeights, all_finite, non_finite_entries


def _reference(t: torch.Tensor) -> int:
    return sum(not math.isfinite(v) for v in t.double().flatten().tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [[], [0], [3, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
def test_counts_inf_and_nan_like_the_reference(dtype, bad):
    t = torch.linspace(-2, 2, 12)
    for n, i in enumerate(bad):
        t[i] = (float("nan"), float("inf"), float("-inf"))[n % 3]
    t = t.to(dtype)
    assert non_finite_entries(t) == _reference(t)
    if dtype is not torch.float8_e4m3fn:      # e4m3fn has no inf: a cast inf saturates
        assert non_finite_entries(t) == len(bad)


def test_integer_empty_and_meta_tensors_have_none():
    assert non_finite_entries(torch.arange(5)) == 0
    assert non_finite_entries(torch.empty(0)) == 0
    assert non_finite_entries(torch.empty(3, device="meta")) == 0


def test_all_finite_screens_by_sums_and_an_overflowing_sum_reads_not_finite():
    ok = [torch.ones(4), torch.zeros(2, dtype=torch.bfloat16), torch.arange(3)]
    assert all_finite(ok)
    assert not all_finite([*ok, torch.tensor([1.0, float("nan")])])
    big = torch.full((4,), 6e4, dtype=torch.float16)          # finite entries, sum overflows
    assert not all_finite([big]) and non_finite_entries(big) == 0


def test_the_error_is_public_and_a_value_error():
    assert geoscale_fx.NonFiniteWeights is NonFiniteWeights
    assert issubclass(NonFiniteWeights, ValueError)
