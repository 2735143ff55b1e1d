"""Attention sites whose q/k/v projections are FP8 linears (``tests.float8_linears``, no
torchao): bounded from the weights, and the bound holds for what the FP8 linears compute.

* an input crafted so that the input cast rounds every entry up (``272.01/448`` of the max:
  just above the midpoint between E4M3's 256 and 288) gives logits 10% over the bound
  without the casts' factor, and under the bound with it;
* random and adversarially optimized inputs (gradient ascent on ``max|S|/bound``), with a
  gain, an offset and biases scaled up, every recipe: ``|S| ≤ bound``, every q/k/v entry
  under its bound;
* a twin whose input scale is not from its values is refused, naming the call.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import geoscale_fx
from geoscale_fx.numerics.amax import site_amax_bounds
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests.float8_linears import FP8Attention, Recipe, case

D = 16
RECIPES = [Recipe(), Recipe(rows=True, pow2=True), Recipe(rows=True, out_dtype=torch.bfloat16),
           Recipe(emulate=True, pow2=True)]


def _logits_and_qkv(model: FP8Attention, x: torch.Tensor):
    """What the module computes: its logits ``s·q·kᵀ`` (B, H, L, L) and q, k, v (B, H, L, d_h)."""
    b, n, _ = x.shape
    xn = model.normalized(x)
    heads = [lin(xn).view(b, n, model.heads, model.d_h).transpose(1, 2)
             for lin in (model.q, model.k, model.v)]
    return heads[0] @ heads[1].transpose(-1, -2) * model.d_h ** -0.5, heads


def _site(model, x):
    site, = geoscale_fx.find_attention(model, x)
    assert site.supported and site.bound_by == "weights" and site.certified
    assert all(s.cast is not None for s in (site.terms[0].q, site.terms[0].k, site.value))
    return site


def _without_casts(site):
    """The same site with its sides' casts dropped (the bound of ``x Wᵀ``)."""
    plain = replace(site, terms=tuple(replace(t, q=replace(t.q, cast=None),
                                              k=replace(t.k, cast=None)) for t in site.terms))
    object.__setattr__(plain, "_resolve", site._resolve)
    return plain


def test_casts_that_round_up_break_the_bound_of_x_w_and_not_the_certified_one():
    model = FP8Attention(D, 1, Recipe()).eval()
    with torch.no_grad():
        for lin in (model.q, model.k):
            lin.weight.copy_(torch.eye(D))       # W̃ = W: only the input's cast differs
    row = torch.full((D,), 272.01 / 448)
    row[0] = 1.0
    x = row.expand(1, 4, D).clone()
    site = _site(model, x)
    with torch.no_grad():
        logits, (q, _, _) = _logits_and_qkv(model, x)
    observed = float(logits.abs().max())
    bound = float(site_logit_bound(site).max())
    plain = float(site_logit_bound(_without_casts(site)).max())
    assert plain == pytest.approx(D * D ** -0.5 * D ** -0.5 * 4, rel=1e-6)      # s·ρ²·σ = 4
    assert observed > 1.09 * plain                                   # 4.41: rounded up ~6%
    assert observed <= bound < 1.03 * observed                       # and tight
    assert float(q.abs().max()) <= float(site_amax_bounds(site)["q"].max())


def _ascend(model, site, steps: int = 40) -> float:
    """Adam on the input, maximizing max|S| / bound; the best ratio seen."""
    bound = site_logit_bound(site).float()
    x = torch.randn(2, 6, D, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.1)
    best = 0.0
    for _ in range(steps):
        logits, _ = _logits_and_qkv(model, x)
        ratio = (logits.abs().amax(dim=(0, 2, 3)) / bound).max()
        best = max(best, float(ratio.detach()))
        opt.zero_grad()
        (-ratio).backward()
        opt.step()
    return best


@pytest.mark.parametrize("recipe", [case(r) for r in RECIPES])
def test_bound_holds_for_random_and_optimized_inputs_with_large_gains(recipe):
    torch.manual_seed(0)
    model = FP8Attention(D, 2, recipe, bias=True, affine=True).eval()
    with torch.no_grad():
        model.gain.mul_(4)
        model.offset.mul_(4)
        for lin in (model.q, model.k, model.v):
            lin.bias.mul_(4)
    x = torch.randn(4, 12, D)
    site = _site(model, x)
    bound = site_logit_bound(site)
    amax = site_amax_bounds(site)
    with torch.no_grad():
        logits, (q, k, v) = _logits_and_qkv(model, torch.cat([x, 1e-3 * x, 30 * x]))
    assert bool((logits.abs().amax(dim=(0, 2, 3)).double() <= bound).all())
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert bool((t.abs().amax(dim=(0, 2, 3)).double() <= amax[name]).all()), name
    best = _ascend(model, site)
    assert 0.3 < best <= 1.0, best


def test_a_twin_scaled_by_a_constant_is_refused_naming_the_call():
    model = FP8Attention(D, 1, Recipe(input_scale="static")).eval()
    site, = geoscale_fx.find_attention(model, torch.randn(1, 4, D))
    assert not site.supported
    assert "(_Float8Matmul), which computes with FP8 casts in a form no low-precision " \
        "linear kind recognizes" in site.reason


def test_the_side_names_the_parameter_not_its_transpose():
    model = FP8Attention(D, 1, Recipe(), bias=True).eval()
    site = _site(model, torch.randn(1, 4, D))
    q = site.terms[0].q
    assert (q.layout, q.weight_param, q.bias_param) == ("dense", "q.weight", "q.bias")
