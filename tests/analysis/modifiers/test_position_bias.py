"""geoscale_fx.analysis.modifiers.position_bias: an added term computed from parameters (the
negative twin: an added constant is a mask), baddbmm's β·bias, and its bound and refusal."""
from __future__ import annotations

import torch

from geoscale_fx.analysis.forms.find_sites import find_candidates
from geoscale_fx.analysis.modifiers import position_bias
from geoscale_fx.analysis.modifiers.mask import Mask
from geoscale_fx.analysis.modifiers.position_bias import PositionBias, reads_parameters
from geoscale_fx.analysis.modifiers.softcap import Softcap
from tests.analysis.modifiers.scores import DH, captured, nodes
from tests.analysis_checks import Captured
from tests.test_modifiers import Alibi


def _constant(s):
    return torch.zeros(s.shape[-1], s.shape[-1]).fill_diagonal_(1.0)


def test_an_added_parameter_term_is_a_position_bias_through_either_operand():
    c = captured(lambda m, s: s + m.bias)
    (add,) = nodes(c, "add")
    scores, bias = add.args
    assert reads_parameters(bias, c.kinds) and reads_parameters(scores, c.kinds)
    routes = position_bias.recognize(add, c.kinds)
    assert [(r.operand, r.draft.modifier, r.draft.value, r.masks, r.names_blocker)
            for r in routes] == [(scores, PositionBias, 1.0, True, True),
                                 (bias, PositionBias, 1.0, True, True)]


def test_an_added_constant_is_no_position_bias_and_the_walk_makes_it_a_mask():
    c = captured(lambda m, s: s + _constant(s))
    (add,) = nodes(c, "add")
    scores, constant = add.args
    assert not reads_parameters(constant, c.kinds)
    # only the way through the constant (the scores read the weights) is a position bias
    assert [r.operand for r in position_bias.recognize(add, c.kinds)] == [constant]
    (cand,) = find_candidates(c.gm.graph, c.kinds)
    assert [(d.modifier, d.node) for d in cand.modifiers] == [(Mask, add)]
    assert position_bias.recognize(nodes(c, "mul")[0], c.kinds) is None


def test_the_walk_records_an_added_parameter_term_as_a_position_bias():
    c = captured(lambda m, s: (s + m.bias).masked_fill(m.tri[:6, :6] == 0, float("-inf")))
    (cand,) = find_candidates(c.gm.graph, c.kinds)
    assert [(d.kind, d.node.name, d.value) for d in cand.modifiers][0] == \
        ("position_bias", "add", 1.0)
    assert cand.has_mask and cand.scale == DH ** -0.5


def test_baddbmm_is_the_product_with_its_bias_beta_and_alpha_in_the_scale():
    c = captured(lambda m, s: s)
    assert position_bias.in_product(nodes(c, "matmul")[0], c.kinds) is None
    c = Captured.of(Alibi(beta=0.5), torch.randn(2, 6, 32))
    (baddbmm,) = nodes(c, "baddbmm")
    route = position_bias.in_product(baddbmm, c.kinds)
    assert (route.operand, route.draft.modifier, route.draft.value, route.factor,
            route.masks) == (baddbmm, PositionBias, 0.5, 8 ** -0.5, True)
    (cand,) = find_candidates(c.gm.graph, c.kinds)
    assert cand.scale == 8 ** -0.5 and cand.has_mask
    assert [(d.kind, d.node) for d in cand.modifiers] == [("position_bias", baddbmm),
                                                          ("mask", nodes(c, "masked_fill")[0])]


def test_a_position_bias_bounds_as_a_mask_and_keeps_fp8_qkv_away():
    bound = torch.tensor([3.0, 80.0], dtype=torch.float64)
    assert torch.equal(PositionBias("add", 1.0).transform(bound, (), None), bound)
    assert torch.isinf(PositionBias("add", 1.0).transform(bound, (Softcap("m", 9.0),),
                                                           None)).all()
    assert PositionBias.kind == "position_bias" and not PositionBias.fp8_qkv
