"""geoscale_fx.analysis.forms.measured_sites: an attention the weights cannot bound is bounded by its
q and k measured at every call — the bound equals s·max‖q_h‖·max‖k_g(h)‖ computed here from
the operands in float64, holds on inputs scaled ×1000 (no overflow), follows the input from
call to call, pairs GQA heads, reads einsum layouts; an operand that is not (batch, heads,
positions, d_h) stays refused."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import geoscale_fx
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from geoscale_fx.planning.plan import runnable
from tests.analysis_checks import assert_none_scaling_equals_eager
from tests.attention_variants import D, DH, H, RawQueryIsInput, Unnormalized

FP8_MAX = 448.0


class RawGQA(nn.Module):
    """SDPA with 2 key heads under 4 query heads (``enable_gqa``), on the raw input."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D // 2), nn.Linear(D, D // 2)

    def operands(self, x):
        B, L, _ = x.shape
        return (self.q(x).view(B, L, H, DH).transpose(1, 2),
                self.k(x).view(B, L, H // 2, DH).transpose(1, 2),
                self.v(x).view(B, L, H // 2, DH).transpose(1, 2))

    def forward(self, x):
        q, k, v = self.operands(x)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class RawEinsum(nn.Module):
    """XLNet's layout: (positions, batch, heads, d_h) operands contracted by an einsum."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Parameter(torch.randn(D, H, DH) / 8), nn.Parameter(
            torch.randn(D, H, DH) / 8)
        self.bias = nn.Parameter(torch.randn(H, DH))

    def operands(self, x):
        h = x.transpose(0, 1)                                            # (L, B, D)
        return (torch.einsum("ibh,hnd->ibnd", h, self.q) + self.bias,
                torch.einsum("ibh,hnd->ibnd", h, self.k))

    def forward(self, x):
        q, k = self.operands(x)
        s = torch.einsum("ibnd,jbnd->bnij", q, k) * DH ** -0.5
        return torch.einsum("bnij,jbnd->bnid", s.softmax(-1), k)


def _reference(q: torch.Tensor, k: torch.Tensor, head_axis=1, channel_axis=3, scale=None):
    """s·max‖q_h‖·max‖k_g(h)‖ per query head, float64, from the operands themselves."""
    def per_head(t):
        norms = torch.linalg.vector_norm(t.double(), dim=channel_axis)
        axis = head_axis if head_axis < channel_axis else head_axis - 1
        return norms.movedim(axis, 0).reshape(norms.shape[axis], -1).amax(dim=1)
    nq, nk = per_head(q), per_head(k)
    scale = DH ** -0.5 if scale is None else scale
    return scale * nq * nk.repeat_interleave(nq.numel() // nk.numel())


def _site(model, x):
    site, = geoscale_fx.find_attention(model, x)
    return site


def _audited_bounds(model, x) -> tuple[list[float], list[dict]]:
    wrapped = geoscale_fx.wrap(model, audit=True, compiler="aot_eager")
    with torch.no_grad():
        wrapped(x)
    rows = geoscale_fx.report(wrapped, per_head=True).rows
    return [r["bound"] for r in rows], rows


def test_an_unbounded_site_carries_its_measured_form():
    """Refused by the weights (no normalization), the site keeps the reason and a measured
    alternative that planning runs; a static bound of it is refused, with the reason."""
    site = _site(Unnormalized().eval(), torch.randn(2, 8, D))
    assert not site.supported and "normalization" in site.reason
    measured = runnable(site)
    assert measured is site.measured and measured.supported
    assert measured.bound_by == "measured" and measured.unbounded_reason == site.reason
    assert (measured.n_q_heads, measured.n_kv_heads, measured.head_dim) == (H, H, DH)
    with pytest.raises(ValueError, match="measured at every call"):
        site_logit_bound(measured)


@pytest.mark.parametrize("gain", [1.0, 1000.0])
def test_the_bound_is_the_measured_norms_and_nothing_overflows(gain):
    torch.manual_seed(0)
    model = Unnormalized().eval()
    x = gain * torch.randn(2, 8, D)
    bounds, rows = _audited_bounds(model, x)
    with torch.no_grad():
        q, k, _ = model.block._qkv(x)
    torch.testing.assert_close(torch.tensor(bounds, dtype=torch.float64), _reference(q, k),
                               rtol=1e-5, atol=0)
    assert all(r["overflow_steps"] == 0 for r in rows)
    assert all(r["max_scaled"] <= FP8_MAX for r in rows)
    assert all(r["certified"] for r in rows)


def test_the_bound_follows_the_input_from_call_to_call():
    """Nothing is kept from the weights: a call on ×10 inputs gets a ×100 bound."""
    torch.manual_seed(1)
    model = Unnormalized().eval()           # no biases: q and k are linear in x
    wrapped = geoscale_fx.wrap(model, audit=True, compiler="aot_eager")
    x = torch.randn(2, 8, D)
    with torch.no_grad():
        wrapped(x)
        first = geoscale_fx.report(wrapped).rows[0]["bound"]
        wrapped(10 * x)
        second = geoscale_fx.report(wrapped).rows[0]["bound"]
    assert second == pytest.approx(100 * first, rel=1e-5)
    # nothing from the weights is kept between calls either (no query factor in the state)
    names = [k for k in wrapped.state_dict() if k.startswith("geoscale_state.")]
    assert names and not any("query_factor" in k for k in names)


def test_gqa_pairs_each_query_head_with_its_key_head():
    torch.manual_seed(2)
    model = RawGQA().eval()
    x = 30 * torch.randn(2, 8, D)
    site = runnable(_site(model, x))
    assert (site.n_q_heads, site.n_kv_heads) == (H, H // 2)
    bounds, rows = _audited_bounds(model, x)
    with torch.no_grad():
        q, k, _ = model.operands(x)
    torch.testing.assert_close(torch.tensor(bounds, dtype=torch.float64), _reference(q, k),
                               rtol=1e-5, atol=0)
    assert all(r["overflow_steps"] == 0 for r in rows)


def test_einsum_operands_are_measured_in_their_own_layout():
    """(positions, batch, heads, d_h): the heads are axis 2 of both operands."""
    torch.manual_seed(3)
    model = RawEinsum().eval()
    x = 5 * torch.randn(2, 8, D)
    site = runnable(_site(model, x))
    assert site.bound_by == "measured"
    assert (site.q.observed_axes, site.k.observed_axes) == ((2, 3), (2, 3))
    bounds, _ = _audited_bounds(model, x)
    with torch.no_grad():
        q, k = model.operands(x)
    torch.testing.assert_close(torch.tensor(bounds, dtype=torch.float64),
                               _reference(q, k, head_axis=2, channel_axis=3), rtol=1e-5,
                               atol=0)


def test_operands_without_a_head_axis_stay_refused():
    """softmax(x xᵀ) x on a (B, L, D) input: no head axis to measure per head."""
    site = _site(RawQueryIsInput(), torch.randn(2, 8, D))
    assert not site.supported and site.measured is None
    backend_reason = geoscale_fx.find_attention(RawQueryIsInput(), torch.randn(2, 8, D))[0]
    assert "normalization" in backend_reason.reason or "bound" in backend_reason.reason


def test_scaling_none_equals_eager_and_training_runs():
    torch.manual_seed(4)
    # the rewritten graph runs eagerly (the default compiler, Inductor, has its own tests)
    assert_none_scaling_equals_eager(Unnormalized(), torch.randn(2, 8, D), compiler="eager")
    model = Unnormalized()
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager")
    x = torch.randn(2, 8, D)
    loss = wrapped(x).square().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    row = geoscale_fx.report(wrapped).rows[0]
    assert row["bound"] is not None and math.isfinite(row["bound"])


def test_non_finite_activations_are_named_not_blamed_on_weights():
    """The measured bound reads q and k: an inf in them is reported as such."""
    wrapped = geoscale_fx.wrap(Unnormalized().eval(), compiler="aot_eager")
    x = torch.randn(2, 8, D)
    x[0, 3, 5] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite q or k at attention site"):
        with torch.no_grad():
            wrapped(x)
