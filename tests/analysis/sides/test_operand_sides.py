"""One side of a logit term from what was traced: source, rotary, gains."""
from types import SimpleNamespace

import pytest
import torch

from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.operand_sides import (
    position_gain, projection_side, side_rotary, source_of,
)
from geoscale_fx.analysis.sides.provenance import HeadRows, NormalizedInput, ProjectionOp
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.sites.terms import Rotary

CAND = SimpleNamespace(node=SimpleNamespace(name="attn"))


def _node(name, op="call_function"):
    return SimpleNamespace(name=name, op=op, meta={})


def _rows(features=((0, 1), (2, 3)), rotation=0.0, gain=1.0):
    return HeadRows(features, torch.arange(len(features)), gain, rotation, False)


def test_source_names_the_norm_and_its_channel_ops():
    ln_w = torch.fx.Graph().placeholder("ln_w")
    norm = NormalizedInput("layernorm", _node("ln"), 16, (("mul", ln_w), ("add", 0.5)), 1.25)
    source = source_of(norm)
    assert (source.norm, source.node, source.width) == ("layernorm", "ln", 16)
    assert source.channel_ops == (("mul", "ln_w"), ("add", 0.5))
    assert source.radius == pytest.approx(1.25 * 4.0)


def test_projection_side_reads_weight_bias_and_features():
    norm = NormalizedInput("rmsnorm", _node("rms"), 4, (), 1.0)
    weight, bias = _node("w", "placeholder"), _node("b", "placeholder")
    op = ProjectionOp(_node("linear"), _node("x"), weight, "linear", bias)
    side = projection_side(op, _rows(gain=0.5), norm, [], bias_offset=3)
    assert (side.weight, side.bias, side.layout, side.bias_offset) == ("w", "b", "linear", 3)
    assert side.features == ((0, 1), (2, 3)) and side.operand_gain == 0.5
    assert side.rotary is None


def test_stacked_rotations_multiply_and_are_verified_only_if_all_are():
    rotaries = [Rotary("rotate_half", 1.0, True, (1, 0), "c1", "s1"),
                Rotary("interleaved", 2.0, False, (1, 0), "c2", "s2")]
    rotary = side_rotary(_rows(rotation=2.0), rotaries)
    assert (rotary.cos_node, rotary.factor, rotary.pairing_verified) == ("c2", 2.0, False)
    assert side_rotary(_rows(rotation=0.0), rotaries) is None
    with pytest.raises(Unsupported, match="internal: rotation without a recorded rotary"):
        side_rotary(_rows(rotation=1.0), [])


def test_position_gain_is_the_product_of_whole_operand_multipliers():
    records = ReplayRecords(lambda node: None)
    records.multipliers += [(2.0, torch.arange(4)), (1.5, torch.arange(8)),
                            (9.0, torch.tensor([10, 11]))]    # another operand's
    assert position_gain(CAND, "query", _rows(), records) == pytest.approx(3.0)


def test_a_multiplier_of_part_of_the_head_vectors_is_refused():
    records = ReplayRecords(lambda node: None)
    records.multipliers.append((2.0, torch.tensor([0, 1])))
    with pytest.raises(Unsupported, match="`attn`: a per-position multiplier scales part of "
                                          "the query's head vectors"):
        position_gain(CAND, "query", _rows(), records)
