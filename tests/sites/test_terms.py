"""``geoscale_fx.sites.terms``: what a source, side and term derive from their fields (radius,
head accounting, the graph nodes and parameters a side reads, the gains of rotations and
per-position multipliers), each against a number computed here by hand."""
from __future__ import annotations

import dataclasses
import doctest
import math

import pytest
import torch
import torch.nn.functional as F

from geoscale_fx.sites import terms as site_terms
from geoscale_fx.sites.terms import HeadWeights, Rotary, Side, Source, Term


def _rotary(factor: float) -> Rotary:
    return Rotary(style="rotate_half", factor=factor, pairing_verified=True,
                  pairing=(2, 3, 0, 1), cos_node="cos", sin_node="sin")


def _side(features=((0, 1, 2), (3, 4, 5)), **kw) -> Side:
    return Side(source=kw.pop("source", Source(norm="rmsnorm", node="norm", width=8)),
                weight=kw.pop("weight", "w"), layout=kw.pop("layout", "linear"),
                features=features, **kw)


def test_the_module_example_runs():
    assert doctest.testmod(site_terms).failed == 0


@pytest.mark.parametrize("width, factor", [(1, 1.0), (64, 1.0), (10, 1.5), (4096, 1 / 0.9)])
def test_source_radius_is_the_factor_times_root_width(width, factor):
    radius = Source(norm="layernorm", node="ln", width=width, radius_factor=factor).radius
    assert radius == pytest.approx(factor * math.sqrt(width), rel=1e-15)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_source_radius_bounds_what_the_norm_gives(norm):
    """‖x̂‖ ≤ ρ for torch's own normalizations without affine (equality up to eps and float64
    rounding): the radius is a bound, and a tight one."""
    width = 48
    x = torch.randn(1000, width, dtype=torch.float64) * 30 + 5
    x_hat = F.layer_norm(x, (width,)) if norm == "layernorm" else F.rms_norm(x, (width,))
    norms = x_hat.norm(dim=-1)
    radius = Source(norm=norm, node="n", width=width).radius
    assert float(norms.max()) <= radius * (1 + 1e-12)
    assert float(norms.min()) >= radius * (1 - 1e-4)


def test_side_heads_and_widths_from_the_channel_map():
    side = _side(features=tuple(tuple(range(h * 4, h * 4 + 4)) for h in range(3)))
    assert (side.n_heads, side.head_dim, side.model_dim) == (3, 4, 8)
    assert side.radius == pytest.approx(math.sqrt(8))
    assert (_side(features=()).n_heads, _side(features=()).head_dim) == (0, 0)


def test_a_side_without_weight_maps_its_heads_own_channels():
    """QK-norm: no weight, A_h = diag(gain[features[h]]) maps the head's d_h channels; an
    observed side (a cache) maps nothing: width 1."""
    qk_norm = _side(features=((0, 1), (2, 3), (4, 5)), weight=None, layout="identity")
    assert (qk_norm.model_dim, qk_norm.node_names) == (2, ())
    observed = _side(features=((0,), (1,)), weight=None, layout="observed",
                     observed_axes=(-3, -1))
    assert observed.observed and not observed.incremental and observed.model_dim == 1


def test_side_node_names_list_every_tensor_the_weights_are_computed_from():
    """Weight, inner factor, both adapter factors (a full second weight has no A), bias and
    the source's named channel ops (constants left out), in that order."""
    source = Source(norm="layernorm", node="ln", width=8,
                    channel_ops=(("mul", "ln_w"), ("add", "ln_b"), ("mul", 2.0)))
    side = _side(source=source, inner="inner", bias="b",
                 low_rank=(("lora_a", "lora_b", 0.5), (None, "full", 1.0)))
    assert side.node_names == ("w", "inner", "lora_a", "lora_b", "full", "b", "ln_w", "ln_b")


def test_observed_node_names_are_the_fresh_keys_when_the_past_is_a_running_maximum():
    whole = _side(features=((0,), (1,)), weight=None, layout="observed",
                  source=Source(norm="rmsnorm", node="key", width=8))
    assert whole.node_names == ("key",)
    incremental = dataclasses.replace(whole, observed_past=(("past", 1),),
                                      observed_fresh=(("new_a", 1), ("new_b", 2)))
    assert incremental.incremental and incremental.node_names == ("new_a", "new_b")


def test_side_param_names_skip_the_empty_ones():
    side = _side(weight_param="attn.q.weight", bias_param="",
                 low_rank_params=("attn.q.lora_A", "attn.q.lora_B"))
    assert side.param_names == ("attn.q.weight", "attn.q.lora_A", "attn.q.lora_B")


@pytest.mark.parametrize("fq, fk, gain", [(None, None, 1.0), (1.0, 1.0, 1.0),
                                          (math.sqrt(2), None, math.sqrt(2)),
                                          (0.5, 3.0, 3.0), (2.0, 1.5, 3.0)])
def test_rotation_gain_is_the_product_of_factors_at_least_one(fq, fk, gain):
    q = _side(rotary=_rotary(fq) if fq is not None else None)
    k = _side(rotary=_rotary(fk) if fk is not None else None)
    term = Term(q, k)
    assert term.rope == (fq is not None or fk is not None)
    assert term.rotation_gain == pytest.approx(gain)


def test_operand_scale_multiplies_rotation_and_position_gains():
    plain = Term(_side(position_gain=2.0), _side(position_gain=1.5))
    assert plain.operand_scale == pytest.approx(3.0)
    rotated = Term(_side(rotary=_rotary(1.25), position_gain=2.0), _side())
    assert rotated.operand_scale == pytest.approx(2.5)


def test_term_node_names_are_both_sides_once_in_order():
    """Packed q/k (one weight, one bias): each node once, the query's first."""
    q = _side(bias="qkv_b")
    k = _side(bias="qkv_b", inner="k_inner")
    assert Term(q, k).node_names == ("w", "qkv_b", "k_inner")


def test_parts_are_frozen_and_head_weights_unpack_in_order():
    side = _side()
    with pytest.raises(dataclasses.FrozenInstanceError):
        side.weight = "other"
    a_q, a_k = torch.zeros(2, 8, 3), torch.ones(1, 8, 3)
    unpacked = list(HeadWeights(a_q, None, a_k, None))
    assert len(unpacked) == 4 and unpacked[0] is a_q and unpacked[2] is a_k
    assert unpacked[1] is None and unpacked[3] is None
