"""geoscale_fx.analysis.norms.assembled_writes: a buffer made of slice writes covering its last dim,
in order, is its writes; a gap, or a read before the last write, is not."""
from __future__ import annotations

import torch
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.norms.assembled_writes import assembled_writes


class _Assembled(nn.Module):
    def __init__(self, widths=(6, 2), gap: bool = False):
        super().__init__()
        self.widths, self.gap = widths, gap

    def forward(self, a, b):
        buf = a.new_empty(*a.shape[:-1], sum(self.widths) + (1 if self.gap else 0))
        buf[..., :self.widths[0]].copy_(a)
        start = self.widths[0] + (1 if self.gap else 0)
        buf[..., start:start + self.widths[1]].copy_(b)
        return buf * 1.0


def _writes(**kwargs):
    (graph,) = capture_graphs(_Assembled(**kwargs), torch.randn(2, 3, 6), torch.randn(2, 3, 2))
    buf = next(n for n in graph.gm.graph.nodes
               if n.op == "call_method" and n.target == "new_empty")
    return graph, assembled_writes(buf)


def test_writes_covering_the_last_dim_are_the_buffer():
    graph, writes = _writes()
    assert [(a, b) for a, b, _, _ in writes] == [(0, 6), (6, 8)]
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    assert [src.name for _, _, src, _ in writes] == [p.name for p in placeholders]


def test_a_gap_in_the_writes_is_not_a_buffer_of_them():
    _, writes = _writes(gap=True)
    assert writes is None
