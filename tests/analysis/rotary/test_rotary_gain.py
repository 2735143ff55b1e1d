"""The gain of a rotary embedding: structural, measured (against torch.linalg), complex."""
import math

import pytest
import torch

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.index.index_track import Track
from geoscale_fx.analysis.index.replay_records import ReplayRecords
from geoscale_fx.analysis.rotary.rotary_gain import (
    angles_paired, measured_gain, modulus_bound, structural_gain,
)
from geoscale_fx.analysis.rotary.rotary_terms import RotaryTerm

W = 4
HALF = [(j + W // 2) % W for j in range(W)]          # rotate-half pairing


def _output(fn, *args):
    (graph,) = capture_graphs(fn, *args)
    out = next(n for n in graph.gm.graph.nodes if n.op == "output").args[0]
    return out[0] if isinstance(out, (tuple, list)) else out


def _term(trig, angles, factor, table="t", keeps_last=True):
    return RotaryTerm(Track.root((3, W)), trig, angles, factor, (), keeps_last, table=table)


def test_cat_of_the_same_frequencies_pairs_angles_structurally():
    angles = _output(lambda f: torch.cat((f, f), dim=-1), torch.randn(5, W // 2))
    records = ReplayRecords(lambda node: None)              # nothing evaluable: structure only
    assert angles_paired(records, angles, HALF) is True
    assert angles_paired(records, angles, [j ^ 1 for j in range(W)]) is False


def test_one_shared_angle_gives_m_else_the_certified_fallbacks():
    records = ReplayRecords(lambda node: None)
    angles = _output(lambda f: torch.cat((f, f), dim=-1), torch.randn(5, W // 2))
    cos, sin = _term("cos", angles, 3.0), _term("sin", angles, 3.0)
    assert structural_gain(cos, sin, records, HALF, True, None) == (3.0, True)
    other = _output(lambda f: f * 1.0, torch.randn(5, W))
    assert structural_gain(_term("cos", other, 3.0), _term("sin", other, 3.0), records, HALF,
                           True, None) == (pytest.approx(3.0 * math.sqrt(2.0)), False)
    assert structural_gain(cos, _term("sin", other, 3.0), records, HALF, True,
                           None) == (6.0, False)


def test_measured_gain_is_the_largest_2x2_block_spectral_norm():
    torch.manual_seed(0)
    a, b = torch.randn(6, W, dtype=torch.float64), torch.randn(6, W, dtype=torch.float64)
    records = ReplayRecords(lambda node: {"c": a, "s": b}[node])
    index = torch.tensor(HALF)
    sign = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    got = measured_gain(_term(None, None, 1.0, "c"), _term(None, None, 1.0, "s"), records,
                        index, sign, W, None)
    # out_j = a_j x_j + sign_j b_j x_p: the block over (j, p) as an explicit matrix
    worst = 0.0
    for pos in range(6):
        for j in range(W // 2):
            p = HALF[j]
            block = torch.tensor([[a[pos, j], sign[j] * b[pos, j]],
                                  [sign[p] * b[pos, p], a[pos, p]]], dtype=torch.float64)
            worst = max(worst, float(torch.linalg.matrix_norm(block, ord=2)))
    assert got == pytest.approx(worst, rel=1e-12)


def test_measured_gain_needs_evaluable_tables():
    records = ReplayRecords(lambda node: None)
    assert measured_gain(_term(None, None, 1.0), _term(None, None, 1.0), records,
                         torch.tensor(HALF), torch.ones(W), W, None) is None


def test_modulus_of_a_scaled_polar_of_ones_is_the_scale():
    table = _output(lambda t: torch.polar(torch.ones_like(t), t) * 3.0, torch.randn(5, 2))
    assert modulus_bound(table, ReplayRecords(lambda node: None)) == 3.0
    table = _output(lambda t, r: torch.polar(r, t), torch.randn(5, 2), torch.rand(5, 2))
    assert modulus_bound(table, ReplayRecords(lambda node: None)) is None   # r unknown
