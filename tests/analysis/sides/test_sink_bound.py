"""geoscale_fx.analysis.sides.sink_bound: the side of a data-dependent sink, checked on a captured
``sink_proj(norm(x))`` against its own projection, and the refusal of an unbounded one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.sink_bound import sink_side


class _Sinks(nn.Module):
    """Per-query, per-head sink logits ``(B, H, L, 1)`` from a projection."""

    def __init__(self, normalized: bool):
        super().__init__()
        self.normalized = normalized
        self.norm, self.proj = nn.RMSNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.norm(x) if self.normalized else x
        return self.proj(h).transpose(1, 2).unsqueeze(-1)


def _sink(normalized: bool):
    (graph,) = capture_graphs(_Sinks(normalized), torch.randn(2, 5, 16))
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    out = next(n for n in graph.gm.graph.nodes if op_of(n) == "unsqueeze")
    return out, kinds


def test_a_projected_sink_is_one_width_1_head_per_output_feature_of_its_projection():
    node, kinds = _sink(normalized=True)
    side = sink_side(node, kinds)
    assert side.source.norm == "rmsnorm" and side.source.width == 16
    assert side.layout == "linear" and side.weight is not None
    assert side.features == tuple((f,) for f in range(4))     # every feature it can read


def test_a_sink_from_an_unnormalized_input_is_refused_naming_it():
    node, kinds = _sink(normalized=False)
    with pytest.raises(Unsupported, match="sink logits"):
        sink_side(node, kinds)
