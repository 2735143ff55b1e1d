"""geoscale_fx.analysis.modifiers.softcap: ``c·tanh(y)`` recognised (its scale restarts below
it), and its bound checked against ``c·tanh(S/c)`` computed by hand."""
from __future__ import annotations

import pytest
import torch

from geoscale_fx.analysis.forms.find_sites import find_candidates
from geoscale_fx.analysis.modifiers import softcap
from geoscale_fx.analysis.modifiers.softcap import Softcap
from tests.analysis.modifiers.scores import DH, captured, nodes


@pytest.mark.parametrize("cap", [30.0, -7.0])
def test_c_tanh_y_is_a_route_through_y_with_the_factor_c(cap):
    c = captured(lambda m, s: torch.tanh(s / cap) * cap)
    (tanh,) = nodes(c, "tanh")
    mul = nodes(c, "mul")[-1]
    (route,) = softcap.recognize(mul, c.kinds)
    assert (route.operand, route.draft.modifier, route.draft.node, route.draft.value) == \
        (tanh.args[0], Softcap, mul, abs(cap))
    assert (route.factor, route.logits, route.masks) == (cap, True, False)
    (cand,) = find_candidates(c.gm.graph, c.kinds)
    assert cand.scale == pytest.approx(DH ** -0.5, rel=1e-12)   # (s/c)·c
    assert cand.roles["logits"] is mul and cand.roles["scores"] is nodes(c, "matmul")[0]


def test_factors_after_the_cap_do_not_scale_the_scores():
    c = captured(lambda m, s: 3.0 * (torch.tanh(s / 20.0) * 20.0))
    (cand,) = find_candidates(c.gm.graph, c.kinds)
    assert cand.scale == pytest.approx(DH ** -0.5, rel=1e-12) and \
        [d.kind for d in cand.modifiers] == ["softcap"]


@pytest.mark.parametrize("f,op", [(lambda m, s: torch.tanh(s) + 0.0, "add"),
                                  (lambda m, s: s * 20.0, "mul"),
                                  (lambda m, s: torch.tanh(s) * m.tri[:6, :6], "mul")])
def test_a_tanh_without_a_scalar_cap_or_a_cap_without_tanh_is_no_softcap(f, op):
    c = captured(f)
    assert softcap.recognize(nodes(c, op)[-1], c.kinds) is None
    assert softcap.in_product(nodes(c, "matmul")[0], c.kinds) is None


@pytest.mark.parametrize("cap", [5.0, -5.0, 1e4])
def test_the_bound_is_min_of_the_bound_and_c_and_covers_c_tanh_s_over_c(cap):
    """Random S per head (float64), some heads far past the cap: the observed
    ``max|c·tanh(S/c)|`` stays within ``min(max|S|, |c|)`` and reaches it where tanh
    saturates or is linear."""
    torch.manual_seed(0)
    spread = torch.tensor([0.01, 1.0, 50.0, 1e3], dtype=torch.float64)
    s = torch.randn(4, 32, 32, dtype=torch.float64) * spread[:, None, None]      # (H, L, L)
    bound = s.abs().amax(dim=(1, 2))
    observed = (cap * torch.tanh(s / cap)).abs().amax(dim=(1, 2))
    capped = Softcap("mul", abs(cap)).transform(bound, (), None)
    assert torch.equal(capped, torch.clamp(bound, max=abs(cap)))
    assert bool((observed <= capped).all())
    tight = (bound < abs(cap) / 100) | (bound > abs(cap) * 100)    # tanh linear or saturated
    assert bool(tight.any()) and bool((observed[tight] >= 0.99 * capped[tight]).all())
    assert Softcap.caps and not Softcap.fp8_qkv
