"""geoscale_fx.analysis.norms.bounded_operand: an operand that is a view of a normalized or
value-bounded tensor has that tensor as its root; a graph input, or a tensor written in
place in the graph, does not."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.norms.bounded_operand import bounded_root
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of


class _Pooling(nn.Module):
    """A learned query (4 heads of 8) over RMSNorm'd keys; ``raw``: the keys unnormalized."""

    def __init__(self, raw: bool = False):
        super().__init__()
        self.raw = raw
        self.query = nn.Parameter(torch.randn(32))
        self.norm = nn.RMSNorm(32, elementwise_affine=False)

    def forward(self, x):
        b, l, _ = x.shape
        k = (x if self.raw else self.norm(x)).view(b, l, 4, 8).transpose(1, 2)
        q = self.query.view(1, 4, 1, 8).expand(b, 4, 1, 8)
        return F.scaled_dot_product_attention(q, k, k)


def _operands(raw: bool):
    (graph,) = capture_graphs(_Pooling(raw), torch.randn(2, 5, 32))
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    sdpa = next(n for n in graph.gm.graph.nodes if op_of(n) == "sdpa")
    return sdpa.args[0], sdpa.args[1], kinds


def test_a_viewed_parameter_and_a_viewed_norm_output_are_roots():
    q, k, kinds = _operands(raw=False)
    (q_root, q_path), (k_root, k_path) = bounded_root(q, kinds), bounded_root(k, kinds)
    assert q_root.op == "placeholder" and q_path            # the query parameter, viewed
    assert k_root is not k and all(op_of(n) != "sdpa" for n in k_path)


def test_a_view_of_a_graph_input_has_no_root_and_says_why():
    _, k, kinds = _operands(raw=True)
    reason = bounded_root(k, kinds)
    assert isinstance(reason, str) and "not bounded" in reason
