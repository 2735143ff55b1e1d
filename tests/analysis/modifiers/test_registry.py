"""geoscale_fx.analysis.modifiers.registry: the kinds, the walk's dispatch to them (argument
order, precedence per operand), and a new modifier added as one module and one entry."""
from __future__ import annotations

import dataclasses
import sys
from typing import ClassVar

import pytest
import torch
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.analysis.fx.graph_ops import arg, op_of, scalar_constant
from geoscale_fx.analysis.modifiers import mask, position_bias, sink, softcap
from geoscale_fx.analysis.modifiers.draft import ModifierDraft, Route
from geoscale_fx.analysis.modifiers.mask import Mask
from geoscale_fx.analysis.modifiers.position_bias import PositionBias
from geoscale_fx.analysis.modifiers.registry import MODIFIERS, product_routes, routes_through
from geoscale_fx.numerics.head_weights import site_term_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound, term_logit_bound
from geoscale_fx.planning.plan import qkv_fallback_reason
from geoscale_fx.sites.terms import Modifier
from tests.analysis.modifiers.scores import D, H, Scores, captured, nodes
from tests.analysis_checks import Captured, assert_none_scaling_equals_eager, audited_record
from tests.test_modifiers import Alibi


def test_the_kinds_in_their_order_of_precedence():
    assert MODIFIERS == {"softcap": softcap, "position_bias": position_bias, "mask": mask,
                         "sink": sink}
    assert list(MODIFIERS) == ["softcap", "position_bias", "mask", "sink"]
    assert [softcap.Softcap.kind, PositionBias.kind, Mask.kind, sink.Sink.kind] == \
        list(MODIFIERS)


def _constant(s):
    return torch.zeros(s.shape[-1], s.shape[-1]).fill_diagonal_(1.0)


@pytest.mark.parametrize("f,kinds", [
    (lambda m, s: s + _constant(s), [(0, Mask), (1, PositionBias)]),
    (lambda m, s: _constant(s) + s, [(0, PositionBias), (1, Mask)]),
    (lambda m, s: s + m.bias, [(0, PositionBias), (1, PositionBias)]),
])
def test_an_add_is_routed_in_argument_order_a_position_bias_taking_an_operand_first(f, kinds):
    """Per operand, what the op is when the scores come through it: a position bias when
    the other operand reads parameters (the scores read the weights), else a mask."""
    c = captured(f)
    (add,) = nodes(c, "add")
    routes = routes_through(add, c.kinds)
    assert [(r.operand, r.draft.modifier) for r in routes] == [(add.args[i], kind)
                                                                for i, kind in kinds]


def test_an_op_no_kind_recognises_is_none_and_a_recognised_dead_end_is_empty():
    c = captured(lambda m, s: torch.sin(torch.cat([s, s], dim=0)[:2]))
    assert routes_through(nodes(c, "sin")[0], c.kinds) is None
    assert routes_through(nodes(c, "cat")[0], c.kinds) == []


def test_the_product_routes_are_what_baddbmm_and_sdpa_add_to_q_k():
    c = Captured.of(Alibi(beta=2.0), torch.randn(2, 6, 32))
    (route,) = product_routes(nodes(c, "baddbmm")[0], c.kinds)
    assert (route.draft.modifier, route.draft.value) == (PositionBias, 2.0)
    c = captured(lambda m, s: s)
    assert product_routes(nodes(c, "matmul")[0], c.kinds) == []


# --------------------------------------------------------------------------------------
# A new modifier: this test module is its module, ``monkeypatch`` adds its entry
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Clamp(Modifier):
    """``clamp(S, -c, c)``: what leaves it is within ``c``; quantized after it."""
    kind: ClassVar[str] = "clamp"
    caps: ClassVar[bool] = True

    def transform(self, bound, later, resolve):
        return torch.clamp(bound, max=self.value)


def recognize(node, kinds):
    if op_of(node) != "clamp":
        return None
    low, high = (scalar_constant(arg(node, i, name)) for i, name in ((1, "min"), (2, "max")))
    if high is None or low != -high:
        return None
    return (Route(node.args[0], ModifierDraft(Clamp, node, high), logits=True),)


def in_product(node, kinds):
    return None


CAP = 0.5


def _clamped(m, s):
    n = s.shape[-1]
    return torch.clamp(s, -CAP, CAP).masked_fill(m.tri[:n, :n] == 0, float("-inf"))


def _model():
    torch.manual_seed(0)
    model = Scores(_clamped)
    with torch.no_grad():
        model.qkv.weight.mul_(6.0)          # logits far past the clamp
    return model


def test_a_new_modifier_is_one_module_and_one_registry_entry(monkeypatch):
    x = torch.randn(2, 6, D)
    (refused,) = geoscale_fx.find_attention(_model(), x)
    assert not refused.supported and "through `clamp` (clamp)" in refused.reason
    monkeypatch.setitem(MODIFIERS, "clamp", sys.modules[__name__])

    model = _model()
    (site,) = geoscale_fx.find_attention(model, x)
    assert site.supported, site.reason
    assert [type(m) for m in site.modifiers] == [Clamp, Mask] and site.modifier("clamp")
    assert site.node_name("logits") == "clamp" and site.softmax_scale == (D // H) ** -0.5
    raw = sum(term_logit_bound(site, t, hw, "norm_product")
              for t, hw in zip(site.terms, site_term_weights(site)))
    assert bool((raw > CAP).all())
    assert site_logit_bound(site).tolist() == [CAP] * H
    assert qkv_fallback_reason(dataclasses.replace(site, kind="sdpa")) == \
        "score modifiers ['clamp'] before the softmax"

    assert_none_scaling_equals_eager(model, x, compiler="aot_eager")
    record = audited_record(model, x)
    assert counters["geoscale"]["modifier_clamp"] == 1
    assert record.plan.lowering == "inplace" and record.state.overflow_steps.item() == 0
    assert 0 < float(record.state.amax.max()) <= CAP
