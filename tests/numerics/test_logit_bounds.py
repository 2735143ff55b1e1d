"""geoscale_fx.numerics.logit_bounds: the site bound against a float64 brute force, on hand-built sites
(no tracing; the sites of ``tests/numerics/test_head_weights.py``)."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.numerics import logit_bounds
from tests.numerics.test_head_weights import K_FEATURES, Q_FEATURES, D, _site, _tensors


def test_site_bound_is_attained_without_offsets_and_covers_brute_force_with_them():
    t = _tensors(1)
    plain = _site(t, with_affine=False, scale=0.5)
    bound = logit_bounds.site_logit_bound(plain)
    rho = D ** 0.5
    for h in range(3):
        m = t["w"][list(Q_FEATURES[h])].T @ t["w"][list(K_FEATURES[h])]   # x̂ᵀ M ŷ = q_h·k_h
        u, s, vh = torch.linalg.svd(m)
        # attained: x̂ = ρ u₁, ŷ = ρ v₁ gives s·ρ²·σ exactly
        assert float(bound[h]) == pytest.approx(0.5 * rho * rho * float(s[0]), rel=1e-12)
        assert float(0.5 * (rho * u[:, 0]) @ m @ (rho * vh[0])) == pytest.approx(
            float(bound[h]), rel=1e-12)
    affine = _site(t, with_affine=True, scale=0.5)
    bound = logit_bounds.site_logit_bound(affine)
    g = torch.Generator().manual_seed(2)
    x = torch.nn.functional.normalize(torch.randn(4000, D, generator=g, dtype=torch.float64),
                                      dim=-1) * rho                          # ‖x̂‖ = ρ
    y = torch.nn.functional.normalize(torch.randn(4000, D, generator=g, dtype=torch.float64),
                                      dim=-1) * rho
    for h in range(3):
        fq, fk = list(Q_FEATURES[h]), list(K_FEATURES[h])
        q = (t["gain"] * x + t["shift"]) @ t["w"][fq].T + t["b"][fq]
        k = (t["gain"] * y + t["shift"]) @ t["w"][fk].T + t["b"][fk]
        worst = float((0.5 * q @ k.T).abs().max())
        assert worst <= float(bound[h])
        assert worst >= 0.3 * float(bound[h])          # not a vacuous bound


def test_an_unknown_rope_bound_is_refused():
    with pytest.raises(ValueError, match="rope_bound must be one of"):
        logit_bounds.site_logit_bound(_site(_tensors(3), False), rope_bound="bogus")


# --------------------------------------------------------------------------------------
# Operands with no projection: a learned query, RMSNorm'd keys (identity sides)
# --------------------------------------------------------------------------------------

def test_learned_query_over_unweighted_rmsnorm_keys_is_s_times_w_norm_times_sqrt_d():
    """Inkling-2's block attention residual: |S| ≤ s·‖w‖·√d (‖q‖ = ‖w‖, ‖k̂‖ ≤ √d), and a key
    along w attains it."""
    import geoscale_fx
    from tests.attention_variants import StackedStatesPooling

    torch.manual_seed(0)
    model = StackedStatesPooling().eval()
    site, = geoscale_fx.find_attention(model, torch.randn(2, 5, 64))
    w = model.query.detach().double()
    d = w.numel()
    expected = d ** -0.5 * torch.linalg.vector_norm(w) * d ** 0.5
    torch.testing.assert_close(logit_bounds.site_logit_bound(site),
                               expected.reshape(1), rtol=1e-12, atol=0)
    k = d ** 0.5 * w / torch.linalg.vector_norm(w)             # an RMSNorm output, ‖k‖ = √d
    assert float(d ** -0.5 * (w @ k)) == pytest.approx(float(expected), rel=1e-12)


def test_learned_queries_per_head_over_rmsnorm_keys_with_a_gain():
    """Heads split from one D-vector: head h reads channels [h·d_h, (h+1)·d_h) of the query
    rows and of the normalized keys: s·max_r ‖w_r‖·√D·max_{i∈h} |g_i| (float64, by hand)."""
    import geoscale_fx
    from tests.attention_variants import DH, H, LearnedQueryPooling

    torch.manual_seed(0)
    model = LearnedQueryPooling().eval()
    with torch.no_grad():
        model.norm.weight.copy_(torch.linspace(-3.0, 2.0, 64))
    site, = geoscale_fx.find_attention(model, torch.randn(2, 5, 64))
    assert site.q.layout == site.k.layout == "identity"
    assert site.q.features == site.k.features == tuple(
        tuple(range(h * DH, (h + 1) * DH)) for h in range(H))
    rho_q = torch.linalg.vector_norm(model.query.detach().double(), dim=-1).max()
    g = model.norm.weight.detach().double().reshape(H, DH).abs().amax(dim=-1)
    expected = DH ** -0.5 * rho_q * 64 ** 0.5 * g
    torch.testing.assert_close(logit_bounds.site_logit_bound(site), expected, rtol=1e-12,
                               atol=0)
