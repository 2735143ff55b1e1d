"""Rotary embeddings recognised on a projection's path and recorded as ``Rotary``."""
import pytest
import torch
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.evaluate import ParamEvaluator
from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.provenance import trace_operand
from geoscale_fx.analysis.index.replay_records import ReplayRecords

B, L, D = 2, 5, 8


class Roped(nn.Module):
    def __init__(self, turn, scale=1.0, form="tables"):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(D), nn.Linear(D, D)
        self.turn, self.scale, self.form = turn, scale, form

    def forward(self, x):
        q = self.proj(self.norm(x))                                        # (B, L, D)
        freqs = torch.arange(L, dtype=torch.float32)[:, None] * torch.rand(D // 2)
        if self.form == "complex":
            z = torch.polar(torch.ones_like(freqs), freqs) * self.scale
            return torch.view_as_real(torch.view_as_complex(q.view(B, L, D // 2, 2)) * z) \
                .flatten(-2)
        angles = torch.cat((freqs, freqs), dim=-1)                         # (L, D)
        return q * (self.scale * angles.cos()) + self.turn(q) * (self.scale * angles.sin())


def _rotate_half(t):
    return torch.cat((-t[..., D // 2:], t[..., :D // 2]), dim=-1)


def _trace(module):
    (graph,) = capture_graphs(module, torch.randn(B, L, D))
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    records = ReplayRecords(ParamEvaluator(graph.gm, graph.example_inputs, kinds))
    out = next(n for n in graph.gm.graph.nodes if n.op == "output").args[0][0]
    order = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    return trace_operand(out, kinds, records, "query", order), records


def test_rotate_half_is_a_verified_rotation_with_its_scale():
    trace, records = _trace(Roped(_rotate_half, scale=1.5))
    (rotary,) = records.rotaries
    assert (rotary.style, rotary.form, rotary.pairing_verified) == ("rotate_half", "tables",
                                                                    True)
    assert rotary.factor == pytest.approx(1.5)
    assert rotary.pairing == (4, 5, 6, 7, 0, 1, 2, 3)
    assert float(trace.track.rot.max()) == pytest.approx(1.5)
    ((features, partners),) = records.partners
    assert sorted(zip(features.tolist(), partners.tolist()))[:2] == [(0, 4), (1, 5)]


def test_complex_multiply_by_a_polar_of_ones_is_an_interleaved_rotation():
    _, records = _trace(Roped(None, scale=2.0, form="complex"))
    (rotary,) = records.rotaries
    assert (rotary.style, rotary.form, rotary.pairing_verified) == ("interleaved", "complex",
                                                                    True)
    assert rotary.factor == pytest.approx(2.0)


def test_a_sin_term_that_is_not_a_pairwise_swap_is_refused():
    with pytest.raises(Unsupported, match="the sin term is not a pairwise swap of the cos "
                                          "term's elements"):
        _trace(Roped(lambda t: torch.cat((t[..., 1:], t[..., :1]), dim=-1)))   # a cycle
