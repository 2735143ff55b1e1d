"""tests/float_checks.py: the comparisons themselves, each against values placed a known number
of ulps from their reference with ``torch.nextafter``."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.core.bounds import round_up_f32
from tests.float_checks import (F64_SLACK, assert_certified, assert_close_ulps,
                                assert_tensors_close_ulps, f32_sum_ulps, ulp)


def _steps(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` moved ``n`` representable values up (n > 0) or down (n < 0) in its dtype."""
    target = torch.full_like(x, float("inf") if n > 0 else float("-inf"))
    for _ in range(abs(n)):
        x = torch.nextafter(x, target)
    return x


def _exact_f32(n: int = 200) -> torch.Tensor:
    """Float32 values of many magnitudes (both signs, a subnormal, zero), as float64."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-30, 30, (n,), generator=g))
    return torch.cat([x, torch.tensor([0.0, 1e-40, 448.0, -3.0])]).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ulp_is_the_distance_to_the_next_value_of_the_dtype(dtype):
    x = _exact_f32().to(dtype).abs()
    torch.testing.assert_close(ulp(x, dtype), (_steps(x, 1) - x).double(), rtol=0, atol=0)


def test_a_scale_rounded_up_from_its_bound_is_certified_and_one_ulp_under_it_is_not():
    bound = torch.rand(500, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    exact = bound * 37.0 / 448.0
    assert_certified(round_up_f32(exact), exact)                     # [B, B + 1 ulp)
    on_grid = exact.float().double()                  # references that are float32 values
    scale = on_grid.float()
    assert_certified(scale, on_grid, ulps=0)
    for i in range(0, 500, 97):                       # one entry one float32 ulp low fails
        low = scale.clone()
        low[i] = _steps(low[i], -1)
        with pytest.raises(AssertionError, match="below its certified reference at 1 of"):
            assert_certified(low, on_grid)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_more_than_k_ulps_above_fails_and_k_passes(k):
    ref = _exact_f32()
    actual = _steps(ref.float(), k)
    assert_certified(actual, ref, ulps=k)
    with pytest.raises(AssertionError, match=rf"more than {k} ulps"):
        assert_certified(_steps(actual, 1), ref, ulps=k)


def test_rtol_widens_the_room_above_only():
    ref = torch.tensor([100.0, 2.0], dtype=torch.float64)
    assert_certified(torch.tensor([100.5, 2.0]), ref, rtol=1e-2)
    with pytest.raises(AssertionError, match="above"):
        assert_certified(torch.tensor([101.5, 2.0]), ref, rtol=1e-2)
    with pytest.raises(AssertionError, match="below"):
        assert_certified(torch.tensor([99.9, 2.0]), ref, rtol=1e-2)


def test_the_reference_may_carry_float64_rounding_and_no_more():
    ref = torch.tensor([3.0, 1e-20, 7e30], dtype=torch.float64)
    assert_certified(ref * (1 - F64_SLACK / 2), ref, ulps=0)         # float64 noise
    with pytest.raises(AssertionError, match="below"):
        assert_certified(ref * (1 - 2 * F64_SLACK), ref, ulps=0)
    assert F64_SLACK < 2.0 ** -24 / 1000                # ≪ the smallest float32 step at 1


def test_nan_shape_and_infinities():
    ref = torch.tensor([1.0, float("inf")], dtype=torch.float64)
    assert_certified(torch.tensor([1.0, float("inf")]), ref)
    with pytest.raises(AssertionError, match="infinite reference"):
        assert_certified(torch.tensor([1.0, 3.0e38]), ref)
    with pytest.raises(AssertionError, match="NaN"):
        assert_certified(torch.tensor([float("nan"), float("inf")]), ref)
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_certified(torch.tensor([1.0]), ref)
    with pytest.raises(AssertionError, match="floats expected"):
        assert_close_ulps(torch.tensor([1, 2]), torch.tensor([1, 2]), ulps=0)


def test_close_ulps_has_no_direction_and_counts_in_the_coarser_dtype():
    a = _exact_f32().float()
    for k in (0, 2):
        assert_close_ulps(_steps(a, k), a, ulps=k)
        assert_close_ulps(_steps(a, -k), a, ulps=k)
        with pytest.raises(AssertionError, match=rf"more than {k} torch.float32 ulps"):
            assert_close_ulps(_steps(a, -k - 1), a, ulps=k)
    x = torch.tensor([1.0], dtype=torch.float64)
    assert_close_ulps(x + 2.0 ** -30, x.float(), ulps=1)            # float32's ulp: 2⁻²³
    with pytest.raises(AssertionError, match="float64 ulps"):
        assert_close_ulps(x + 2.0 ** -30, x, ulps=1)


def test_two_float32_summation_orders_stay_within_f32_sum_ulps():
    """The stated bound against float32 sums in opposite sequential orders and torch's own
    (blocked, vectorized) order, positive terms spread over six decades."""
    g = torch.Generator().manual_seed(3)
    for n in (16, 64, 384):
        for _ in range(20):
            x = torch.rand(n, generator=g) * torch.pow(10.0, 6 * torch.rand(n, generator=g))
            forward, backward = x.cumsum(0)[-1], x.flip(0).cumsum(0)[-1]   # sequential
            exact = x.double().sum()
            for s in (forward, backward, x.sum()):              # each: n − 1 ulps
                assert_close_ulps(s, exact, ulps=f32_sum_ulps(n) // 2, dtype=torch.float32)
            assert_close_ulps(forward, backward, ulps=f32_sum_ulps(n))


def test_maps_of_tensors_need_the_same_names_and_dtypes_and_close_values():
    ref = {"a.k_scale": torch.tensor([0.5, 2.0]), "a.v_scale": torch.tensor([1.0])}
    near = {"a.k_scale": _steps(ref["a.k_scale"], 1), "a.v_scale": ref["a.v_scale"]}
    assert_tensors_close_ulps(near, ref, ulps=1)
    with pytest.raises(AssertionError, match="a.k_scale: more than 0"):
        assert_tensors_close_ulps(near, ref, ulps=0)
    with pytest.raises(AssertionError, match=r"names differ: \['a.v_scale'\]"):
        assert_tensors_close_ulps({"a.k_scale": ref["a.k_scale"]}, ref, ulps=1)
    with pytest.raises(AssertionError, match="dtype torch.float64"):
        assert_tensors_close_ulps({**ref, "a.v_scale": ref["a.v_scale"].double()}, ref, ulps=1)
