"""Unit tests for ``geoscale_fx.kv_cache.layer_scales``: k/v scales rounded up from certified bounds.

The reference is the contract itself, checked with float32 neighbours (``torch.nextafter``):
the scale is ``≥ bound / R_max`` and its float32 predecessor is not; an entry at the bound
then never exceeds R_max after division.
"""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.kv_cache.layer_scales import LayerScales, scale_from_bound

R_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
TINY = torch.finfo(torch.float32).tiny


def _bounds(n: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(-3, 6, generator=g))


@pytest.mark.parametrize("fmt", sorted(R_MAX))
def test_scale_is_the_smallest_float32_at_or_above_bound_over_r_max(fmt):
    bound = _bounds()
    scale = scale_from_bound(bound, fmt)
    assert scale.dtype == torch.float32 and scale.shape == bound.shape
    exact = bound / R_MAX[fmt]
    below = torch.nextafter(scale, torch.zeros_like(scale))
    assert bool((scale.double() >= exact).all())
    assert bool((below.double() < exact).all())
    # an entry at the bound stays within the format's range after division (float64)
    assert bool((bound / scale.double() <= R_MAX[fmt]).all())


def test_scale_rounds_up_where_round_to_nearest_would_go_down():
    """Bounds whose quotient rounds down to nearest float32: the scale is one ulp above it
    (a scale from ``.float()`` would let an entry at the bound saturate)."""
    bound = _bounds(seed=1)
    exact = bound / 448.0
    nearest = exact.float()
    down = nearest.double() < exact
    assert int(down.sum()) > 100
    scale = scale_from_bound(bound[down], "e4m3")
    assert torch.equal(scale, torch.nextafter(nearest[down], torch.full_like(nearest[down],
                                                                              float("inf"))))
    assert bool((bound[down] / nearest[down].double() > 448.0).all())


def test_a_zero_bound_gives_the_smallest_normal_float32():
    scale = scale_from_bound(torch.zeros(3, dtype=torch.float64), "e4m3")
    assert torch.equal(scale, torch.full((3,), TINY))


def test_layer_scales_are_per_kv_head_for_fp8_and_global_scales_for_nvfp4():
    k_bound = torch.tensor([448.0, 1.0], dtype=torch.float64)
    v_bound = torch.tensor([0.5, 896.0], dtype=torch.float64)
    layer = LayerScales(1, "model.layers.1.self_attn", torch.ones(4, dtype=torch.float64),
                        k_bound, v_bound)
    k_scale, v_scale = layer.scales("e4m3")
    assert k_scale.dtype == torch.float32 and k_scale.shape == (2,)
    assert k_scale[0] == 1.0 and v_scale[1] == 2.0             # exact quotients stay exact
    assert bool((k_scale.double() * 448.0 >= k_bound).all())
    k_g, v_g = layer.scales("nvfp4")
    assert k_g.dtype == torch.float32 and k_g.shape == (2,)
    # a block at the bound needs a block scale amax / 6 / s_g ≤ 448 (E4M3)
    for g, bound in ((k_g, k_bound), (v_g, v_bound)):
        assert bool((bound / 6.0 / g.double() <= 448.0).all())
        assert bool((bound / 6.0 / g.double() > 447.0).all())     # not a loose bound either
    with pytest.raises(ValueError, match="e4m3"):
        layer.scales("int8")
