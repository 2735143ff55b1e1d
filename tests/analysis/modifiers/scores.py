"""The attention the modifier tests capture: ``softmax(f(s·q kᵀ)) @ v`` with ``f`` given, and
the graph nodes a recognizer is asked about."""
from __future__ import annotations

import torch
from torch import nn
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import op_of
from tests.analysis_checks import Captured

D, H = 16, 2
DH = D // H


class Scores(nn.Module):
    """Explicit attention over a LayerNorm'd input whose scores go through ``f(self, s)``
    (``s = d_h^-½ · q kᵀ``, (B, H, L, L)); ``bias`` (a parameter per head), ``tri`` (a 0/1
    causal buffer) and ``sinks`` (a parameter per head) are there for ``f`` to use."""

    def __init__(self, f):
        super().__init__()
        self.f = f
        self.norm, self.qkv = nn.LayerNorm(D), nn.Linear(D, 3 * D)
        self.bias = nn.Parameter(torch.randn(H, 1, 1))
        self.sinks = nn.Parameter(torch.tensor([3.0, -40.0]))
        self.register_buffer("tri", torch.ones(8, 8).tril())

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, H, DH).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(self.f(self, q @ k.transpose(-1, -2) * DH ** -0.5), dim=-1)
        return probs[..., :n] @ v                                       # (B, H, L, d_h)


def captured(f) -> Captured:
    """``Scores(f)`` captured on a (2, 6, D) input."""
    torch.manual_seed(0)
    return Captured.of(Scores(f), torch.randn(2, 6, D))


def nodes(c: Captured, op: str) -> list[Node]:
    """The graph's nodes of ``op`` (``graph_ops.op_of``), in graph order."""
    return [n for n in c.gm.graph.nodes if op_of(n) == op]
