"""``site_fields``: the AttentionSite fields every analyzer fills."""
import math
from types import SimpleNamespace

import pytest
import torch

from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.forms.site_fields import site_fields
from geoscale_fx.analysis.modifiers.draft import ModifierDraft
from geoscale_fx.analysis.modifiers.mask import Mask
from geoscale_fx.analysis.modifiers.sink import Sink, SinkDraft
from geoscale_fx.analysis.modifiers.softcap import Softcap
from geoscale_fx.sites.terms import Modifier


def _node(name, op="call_function"):
    return SimpleNamespace(name=name, op=op)


def _cand(scale=0.25, modifiers=()):
    return SimpleNamespace(scale=scale, node=_node("softmax"), is_causal=True, has_mask=False,
                           dropout_p=0.1, modifiers=modifiers)


def _term(n_q=4, n_kv=2, d_h=8):
    side = lambda n: SimpleNamespace(n_heads=n, head_dim=d_h)   # noqa: E731
    return SimpleNamespace(q=side(n_q), k=side(n_kv))


def test_fields_carry_scale_times_gain_heads_and_modifiers_in_order():
    mods = (ModifierDraft(Mask, _node("add")), SinkDraft(Sink, _node("sinks", "placeholder")),
            ModifierDraft(Softcap, _node("mul"), 30.0))
    term = _term()
    fields = site_fields(_cand(modifiers=mods), [term], 2.0, 5, 7, torch.arange(4).repeat(2, 1))
    assert fields["softmax_scale"] == pytest.approx(0.5) and fields["score_scale"] == 0.25
    assert (fields["n_q_heads"], fields["n_kv_heads"], fields["head_dim"]) == (4, 2, 8)
    assert (fields["q_len"], fields["kv_len"], fields["is_causal"]) == (5, 7, True)
    assert fields["terms"] == (term,) and fields["dropout_p"] == 0.1
    assert fields["score_heads"] == (0, 1, 2, 3) and fields["score_lead"] == ()
    kinds = [(m.kind, m.node, m.param) for m in fields["modifiers"]]
    assert kinds == [("mask", "add", None), ("sink", "sinks", "sinks"), ("softcap", "mul", None)]
    assert [type(m) for m in fields["modifiers"]] == [Mask, Sink, Softcap]
    assert isinstance(fields["modifiers"][2], Modifier) and fields["modifiers"][2].value == 30.0


def test_head_dim_given_overrides_the_sides():
    fields = site_fields(_cand(), [_term(d_h=8)], 1.0, 1, 1, torch.arange(4), head_dim=16)
    assert fields["head_dim"] == 16


@pytest.mark.parametrize("scale", [math.nan, math.inf])
def test_a_scale_that_is_not_a_constant_is_refused(scale):
    with pytest.raises(Unsupported, match="`softmax`: the softmax scale is not a "
                                          "compile-time constant"):
        site_fields(_cand(scale=scale), [_term()], 1.0, 1, 1, torch.arange(4))


def test_a_sink_computed_without_the_graph_kinds_is_refused():
    mods = (SinkDraft(Sink, _node("sink_proj")),)
    with pytest.raises(Unsupported, match="sink logits `sink_proj` are computed from the "
                                          "activations"):
        site_fields(_cand(modifiers=mods), [_term()], 1.0, 1, 1, torch.arange(4))
