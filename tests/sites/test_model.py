"""geoscale_fx.sites.model: the site as plain data — its derived views, exact values by hand."""
from __future__ import annotations

import math

import pytest

from geoscale_fx.analysis.modifiers.sink import Sink
from geoscale_fx.sites.model import ROPE_BOUNDS, AttentionSite
from geoscale_fx.sites.terms import Modifier, Rotary, Side, Source, Term


def _rotary(factor: float) -> Rotary:
    return Rotary("rotate_half", factor, True, (1, 0), "cos", "sin")


def _side(weight="wq", bias=None, rotary=None, ops=(), **kw) -> Side:
    return Side(Source("rmsnorm", "norm", 16, ops), weight, "linear", ((0, 1), (2, 3)),
                bias=bias, rotary=rotary, **kw)


def test_source_radius_and_side_shapes():
    assert Source("layernorm", "ln", 64).radius == 8.0
    # training-mode dropout p=0.5 before the projection doubles the radius: 2·√d
    assert Source("layernorm", "ln", 64, radius_factor=2.0).radius == 16.0
    side = _side()
    assert (side.n_heads, side.head_dim, side.model_dim, side.radius) == (2, 2, 16, 4.0)
    qk_norm = Side(Source("rmsnorm", "q_norm", 2, channel_index=(0, 1, 0, 1)), None, "identity",
                   ((0, 1), (2, 3)))
    assert qk_norm.model_dim == 2                       # a QK-norm side maps d_h channels
    observed = Side(Source("rmsnorm", "keys", 2), None, "observed", ((0,), (1,)),
                    observed_axes=(1, 3))
    assert observed.observed and not observed.incremental and observed.model_dim == 1


def test_term_operand_scale_multiplies_rotation_and_position_gains():
    plain = Term(_side(), _side("wk"))
    assert (plain.rope, plain.rotation_gain, plain.operand_scale) == (False, 1.0, 1.0)
    # an unverified pairing makes a rotation's factor √2; a per-position temperature ≤ 3
    rope = Term(_side(rotary=_rotary(math.sqrt(2)), position_gain=3.0),
                _side("wk", rotary=_rotary(1.0)))
    assert rope.rope
    assert rope.rotation_gain == pytest.approx(math.sqrt(2))
    assert rope.operand_scale == pytest.approx(3 * math.sqrt(2))
    # a factor below 1 never shrinks the bound
    assert Term(_side(rotary=_rotary(0.5)), _side("wk")).rotation_gain == 1.0


def test_node_and_parameter_names_are_collected_once_in_order():
    q = _side("wq", bias="bq", ops=(("mul", "gain"), ("add", 0.5)), weight_param="attn.q.weight",
              bias_param="attn.q.bias", low_rank=(("lora_a", "lora_b", 2.0),),
              low_rank_params=("attn.q.lora_a", "attn.q.lora_b"))
    k = _side("wk", ops=(("mul", "gain"),), weight_param="attn.k.weight")
    site = AttentionSite(name="attn", index=0, kind="sdpa", node="sdpa", supported=True,
                         terms=(Term(q, k),),
                         modifiers=(Sink("cat", param="sinks"),),
                         value=_side("wv", weight_param="attn.v.weight"))
    assert q.node_names == ("wq", "lora_a", "lora_b", "bq", "gain")
    assert site.weight_nodes == ("wq", "lora_a", "lora_b", "bq", "gain", "wk", "sinks")
    assert site.operand_nodes == ("wq", "lora_a", "lora_b", "bq", "gain", "wk", "wv")
    assert site.param_names == ("attn.q.weight", "attn.q.bias", "attn.q.lora_a",
                                "attn.q.lora_b", "attn.k.weight")
    assert site.parameter_nodes == site.weight_nodes            # no observed keys
    assert site.modifier("sink").param == "sinks" and site.modifier("softcap") is None


def test_a_modifier_without_a_kind_refuses_to_transform_a_bound():
    """The base holds the data; a kind (a subclass) says how it transforms the bound."""
    bare = Modifier("add")
    assert (bare.kind, bare.fp8_qkv, bare.caps) == ("", False, False)
    with pytest.raises(NotImplementedError, match="Modifier .no kind. does not say"):
        bare.transform(None, (), None)
    assert (Sink.kind, Sink("cat").param, Sink("cat") == Modifier("cat")) == ("sink", None, False)


def test_observed_keys_are_not_parameter_nodes():
    keys = Side(Source("rmsnorm", "k_cat", 2), None, "observed", ((0,), (1,)),
                observed_axes=(1, 3), observed_past=(("past_k", 1),),
                observed_fresh=(("k_new", 1),))
    site = AttentionSite(name="attn", index=0, kind="sdpa", node="sdpa", supported=True,
                         terms=(Term(_side(), keys),))
    assert keys.incremental and keys.node_names == ("k_new",)
    assert site.cached_keys
    assert "k_new" in site.weight_nodes and "k_new" not in site.parameter_nodes
    assert site.parameter_nodes == ("wq",)


def test_certified_follows_support_and_rope_bound():
    rope_term = Term(_side(rotary=_rotary(1.0)), _side("wk", rotary=_rotary(1.0)))
    site = AttentionSite(name="attn", index=0, kind="sdpa", node="sdpa", supported=True,
                         terms=(rope_term,))
    assert site.rope and site.certified
    paper = site.with_rope_bound("interaction")
    assert paper.rope_bound == "interaction" and not paper.certified
    assert site.rope_bound == "norm_product"                     # frozen: a new site
    assert not AttentionSite(name="a", index=0, kind="sdpa", node="n").certified
    assert ROPE_BOUNDS == ("norm_product", "relative", "interaction")


def test_refusals_name_the_site_and_the_reason():
    site = AttentionSite(name="h.0.attn", index=0, kind="sdpa", node="sdpa", supported=True,
                         terms=(Term(_side(), _side("wk")),) * 2)
    with pytest.raises(ValueError, match="rope_bound must be one of .* got 'exact'"):
        site.with_rope_bound("exact")
    with pytest.raises(ValueError, match="'h.0.attn' has 2 terms; use site.terms"):
        site.q
    with pytest.raises(ValueError, match="'h.0.attn' is not bound to parameter values"):
        site.require_values()
    refused = AttentionSite(name="h.1.attn", index=1, kind="explicit", node="softmax_3",
                            reason="keys are not projected")
    with pytest.raises(ValueError, match=r"'h.1.attn' \(softmax_3\) is not supported: keys"):
        refused.require_values()
