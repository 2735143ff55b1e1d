"""geoscale_fx.planning.qkv_scaling: the fp8_qkv descales, checked against hand computation.

``Read.bound`` for an FP8 cache read (R_cache·|s|·(1 + 2ε)) and an observed read (the exact
amax); ``OperandScaling``'s descales against ``B / (η·R_max)`` from ``amax.site_amax_bounds``
(the saturation, weight-update and decode tests live in tests/test_fp8_qkv.py)."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.numerics.amax import site_amax_bounds
from geoscale_fx.analysis.capture import find_attention
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.planning.qkv_scaling import OperandScaling, Read
from tests.hf_models import build_hf
from tests.float_checks import SCALE_ULPS, assert_certified


def test_fp8_cache_read_bound_by_hand():
    """bf16 operand (ε = 2⁻⁷), e5m2 cache (R = 57344), a negative scale counts by |s|; a
    per-tensor scale covers every kv head."""
    x = torch.zeros(1, 4, 3, 2, dtype=torch.bfloat16)            # (B, H_kv, L, d)
    scale = torch.tensor([0.5, -2.0]).view(1, 2, 1, 1)           # the cache's 2 heads
    got = Read(x, scale, "e5m2", repeat=2).bound()
    margin = 1.0 + 2.0 * 2.0 ** -7
    expected = torch.tensor([0.5, 0.5, 2.0, 2.0], dtype=torch.float64) * 57344.0 * margin
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    one = Read(x, torch.tensor(0.25).view(1, 1, 1, 1), "e4m3").bound()
    assert torch.equal(one, torch.full((4,), 0.25 * 448.0 * margin, dtype=torch.float64))


def test_observed_read_bound_is_the_exact_amax_per_kv_head():
    x = torch.zeros(2, 3, 4, 2)
    x[1, 0, 3, 0] = -7.5                   # the largest magnitude is negative
    x[0, 0, 0, 1] = 2.0
    x[0, 2, 1, 1] = 1e-3
    got = Read(x).bound()
    assert torch.equal(got, torch.tensor([7.5, 0.0, 1e-3], dtype=torch.float32).double())


@pytest.fixture(scope="module")
def llama_site():
    model = build_hf("llama-sdpa")                               # 4 query heads, 2 kv heads
    sites = find_attention(model, inputs_embeds=torch.randn(1, 6, 64))
    return next(s for s in sites if s.supported)


@pytest.mark.parametrize("eta,fmt", [(0.8, "e4m3"), (1.0, "e5m2")])
def test_descales_are_the_amax_bounds_over_eta_r_max(llama_site, eta, fmt):
    site = llama_site
    assert (site.n_q_heads, site.n_kv_heads) == (4, 2)
    options = GeoscaleOptions(lowering="fp8_qkv", eta=eta, fp8_format=fmt)
    policy = OperandScaling(site, options)
    state = {s.name: torch.zeros(s.shape) for s in policy.specs()}
    weights = {n: site._resolve(n) for n in site.operand_nodes}
    dq, dk, dv = policy.descales(weights, state)
    found = site_amax_bounds(site)
    r_max = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    q_per_kv = torch.stack([found["q"][0:2].max(), found["q"][2:4].max()])   # GQA groups
    for got, bound in ((dq, q_per_kv), (dk, found["k"]), (dv, found["v"])):
        assert got.shape == (2,) and got.dtype == torch.float32
        assert_certified(got, bound / (eta * r_max), ulps=SCALE_ULPS)   # rounded up
    # the state repeats each kv head's descale over its query heads
    assert torch.equal(state["k_scale"], dk.repeat_interleave(2))
    assert torch.equal(state["q_bound"], found["q"].float())
