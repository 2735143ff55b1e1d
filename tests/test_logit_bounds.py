"""geoscale_fx.logit_bounds: the site bound against a float64 brute force, on hand-built sites
(no tracing; the sites of ``tests/test_head_weights.py``)."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx import logit_bounds
from tests.test_head_weights import K_FEATURES, Q_FEATURES, D, _site, _tensors


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
