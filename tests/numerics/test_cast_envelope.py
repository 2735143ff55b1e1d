"""numerics.cast_envelope: a low-precision projection's head vectors stay in the envelope.

The reference is the FP8 linear itself (``tests.float8_linears``: torchao's arithmetic, no
torchao), run on normalized inputs: on the sphere ``‖x̂‖ = ρ``, inside it, and with entries
over many binades; with a gain, an offset and a bias, per tensor and per row, a bf16 output.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import geoscale_fx
from geoscale_fx.core import spectral
from geoscale_fx.numerics import logit_bounds
from geoscale_fx.numerics.cast_envelope import entry_bound, widening
from geoscale_fx.numerics.head_weights import site_term_weights
from tests.float8_linears import FP8Attention, ROWWISE, Recipe

D, HEADS = 16, 2
RECIPES = {"tensor": Recipe(), "rows-pow2-bf16": Recipe(rows=True, pow2=True,
                                                         out_dtype=torch.bfloat16)}


def _site(recipe: Recipe, affine: bool = True, bias: bool = True):
    torch.manual_seed(0)
    model = FP8Attention(D, HEADS, recipe, bias=bias, affine=affine).eval()
    site, = geoscale_fx.find_attention(model, torch.randn(1, 4, D))
    return model, site


def _inputs(n: int = 512) -> torch.Tensor:
    """Normalized rows x̂: on the sphere ‖x̂‖ = √D, inside it, and with tiny entries."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, D, generator=gen)
    x = x / x.norm(dim=-1, keepdim=True) * D ** 0.5
    x[n // 3:] *= torch.rand(n - n // 3, 1, generator=gen)
    x[: n // 4] *= torch.exp2(torch.randint(-18, 1, (n // 4, D), generator=gen).float())
    return x


@pytest.mark.parametrize("name", [pytest.param(n, marks=[ROWWISE] if "rows" in n else [])
                                  for n in RECIPES])
def test_each_head_vector_is_within_its_envelope(name):
    model, site = _site(RECIPES[name])
    hw, = site_term_weights(site)
    x_hat = _inputs()
    x = x_hat * model.gain + model.offset
    with torch.no_grad():
        y = model.q(x[None])[0].double().view(len(x), HEADS, D // HEADS)     # (n, H, d_h)
    rho_q, _ = hw.radii(site.terms[0])
    reach = rho_q * spectral.head_spectral_norms(hw.a_q) + hw.cast_q.deviation       # (H,)
    dist = (y - hw.c_q.double()).norm(dim=-1)                                      # (n, H)
    assert bool((dist <= reach).all()), float((dist / reach).max())
    assert float((dist / reach).max()) > 0.5                     # the envelope is not vacuous
    assert hw.cast_q.radius_factor == pytest.approx(1 + 2 ** -4, abs=1e-5)


@ROWWISE
def test_without_offsets_the_ball_is_only_subnormals_and_the_output_rounding():
    _, site = _site(RECIPES["tensor"], affine=False, bias=False)
    hw, = site_term_weights(site)
    norms = spectral.head_spectral_norms(hw.a_q)
    assert bool((hw.cast_q.deviation > 0).all())
    assert bool((hw.cast_q.deviation < 1e-4 * norms).all())        # √d·τ·‖W̃‖ only
    _, site = _site(RECIPES["rows-pow2-bf16"], affine=False, bias=False)
    hw, = site_term_weights(site)
    ratio = hw.cast_q.deviation / (hw.radii(site.terms[0])[0] * spectral.head_spectral_norms(
        hw.a_q))
    assert bool((ratio > 2 ** -8).all()) and bool((ratio < 2 ** -8 + 1e-4).all())  # u_o·P


@ROWWISE
def test_widening_and_the_norm_product_route():
    _, site = _site(RECIPES["rows-pow2-bf16"])
    term = site.terms[0]
    hw, = site_term_weights(site)
    rho_q, rho_k = hw.radii(term)
    n_q = rho_q * spectral.head_spectral_norms(hw.a_q) + hw.c_q.double().norm(dim=-1)
    n_k = rho_k * spectral.head_spectral_norms(hw.a_k) + hw.c_k.double().norm(dim=-1)
    r_q, r_k = hw.cast_q.deviation, hw.cast_k.deviation
    s = abs(site.softmax_scale)
    by_hand = s * (r_q * n_k + n_q * r_k + r_q * r_k)
    torch.testing.assert_close(widening(term, hw, site.softmax_scale), by_hand)
    product = logit_bounds.norm_product_bound(term, hw, spectral.head_spectral_norms(hw.a_q),
                                              spectral.head_spectral_norms(hw.a_k),
                                              site.softmax_scale)
    torch.testing.assert_close(product, s * (n_q + r_q) * (n_k + r_k))
    plain = replace(hw, cast_q=None, cast_k=None)
    assert float(widening(term, plain, site.softmax_scale)) == 0.0
    assert plain.radii(term) == (term.q.radius, term.k.radius)


def test_entry_bound():
    g, b = torch.tensor([1.0, -3.0, 0.5]), torch.tensor([0.0, 1.0, -4.0])
    assert float(entry_bound(g, b, 2.0)) == 7.0           # max(2, 6 + 1, 1 + 4)
    assert float(entry_bound(None, None, 2.0)) == 2.0
    assert float(entry_bound(None, b, torch.tensor(1.0))) == 5.0
