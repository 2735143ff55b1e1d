"""geoscale_fx.analysis.modifiers.mask: the mask ops recognised (and those left to the scale
or refused), an SDPA's own mask, and the bound it leaves — or gives up before a cap."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from geoscale_fx.analysis.modifiers import mask
from geoscale_fx.analysis.modifiers.mask import Mask
from geoscale_fx.analysis.modifiers.softcap import Softcap
from geoscale_fx.numerics.logit_bounds import apply_modifiers
from tests.analysis.modifiers.scores import captured, nodes
from tests.analysis_checks import Captured


def _causal(s):
    n = s.shape[-1]
    return torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -1e4)


def _routes(f, op):
    c = captured(f)
    node = nodes(c, op)[-1]
    return node, mask.recognize(node, c.kinds)


@pytest.mark.parametrize("f,op,through", [
    (lambda m, s: s + _causal(s), "add", [0, 1]),
    (lambda m, s: s - _causal(s), "sub", [0]),
    (lambda m, s: s.masked_fill(m.tri[:6, :6] == 0, float("-inf")), "masked_fill", [0]),
    (lambda m, s: torch.where(m.tri[:6, :6] > 0, s, -1e4), "where", [1, 2]),
    (lambda m, s: torch.max(s, torch.tensor(-1e9)), "max", [0]),
    (lambda m, s: s * m.tri[:6, :6], "mul", [0]),
    (lambda m, s: m.tri[:6, :6] * s, "mul", [1]),
])
def test_each_mask_op_is_a_route_through_the_operands_the_scores_may_come_through(f, op,
                                                                                  through):
    node, routes = _routes(f, op)
    assert [r.operand for r in routes] == [node.args[i] for i in through]
    assert all((r.draft.modifier, r.draft.node, r.masks, r.names_blocker, r.factor, r.logits)
               == (Mask, node, True, True, 1.0, False) for r in routes)


@pytest.mark.parametrize("f,op", [
    (lambda m, s: s * 0.5, "mul"),                                  # the softmax scale
    (lambda m, s: torch.max(s, s.transpose(-1, -2)), "max"),      # no constant floor
    (lambda m, s: torch.sin(s), "sin"),
])
def test_ops_that_are_no_mask_are_not_recognised(f, op):
    assert _routes(f, op)[1] is None


@pytest.mark.parametrize("kwargs,masks", [(dict(is_causal=True), False),
                                          (dict(attn_mask=torch.ones(5, 5).tril().bool()), True),
                                          (dict(), None)])
def test_an_sdpa_mask_or_causal_flag_is_a_mask_of_the_product(kwargs, masks):
    q = torch.randn(1, 2, 5, 8)
    c = Captured.of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs),
                    q, q.clone(), q.clone())
    (sdpa,) = [n for n in c.gm.graph.nodes if n.op == "call_function" and "scaled_dot" in
               str(n.target)]
    route = mask.in_product(sdpa, c.kinds)
    if masks is None:
        assert route is None
    else:
        assert (route.operand, route.draft.modifier, route.draft.node, route.masks) == \
            (sdpa, Mask, sdpa, masks)
    assert mask.in_product(nodes(captured(lambda m, s: s), "matmul")[0], c.kinds) is None


def test_a_mask_leaves_the_bound_of_the_quantized_scores_as_it_is():
    bound = torch.tensor([3.0, 80.0], dtype=torch.float64)
    assert torch.equal(Mask("add").transform(bound, (), None), bound)
    assert torch.equal(Mask("add").transform(bound, (Mask("fill"),), None), bound)
    assert Mask.fp8_qkv and not Mask.caps


def test_a_mask_before_a_softcap_leaves_only_the_cap_as_a_bound():
    """c·tanh((S + M)/c) with |S| ≤ 1 and M = 10⁴ reaches c: no bound from S holds after the
    cap, so the mask makes it inf and the cap makes it c (recomputed by hand)."""
    s = torch.rand(2, 6, 6, dtype=torch.float64) * 2 - 1                    # (H, L, L)
    capped = 5.0 * torch.tanh((s + 1e4 * torch.ones(6, 6).triu(1)) / 5.0)
    observed = capped.abs().amax(dim=(1, 2))
    bound = s.abs().amax(dim=(1, 2))
    assert bool((observed > bound).all())                   # min(B, c) = B would not hold
    assert torch.isinf(Mask("add").transform(bound, (Softcap("mul", 5.0),), None)).all()
    out = apply_modifiers(bound, (Mask("add"), Softcap("mul", 5.0)))
    assert out.tolist() == [5.0, 5.0] and bool((observed <= out).all())
