"""geoscale_fx.analysis.evaluate: ``ParamEvaluator`` gives the *current* value of parameter-only
nodes (compared with eager recomputation) and None for anything that reads a user input."""
from __future__ import annotations

import torch
import torch.nn as nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.evaluate import ParamEvaluator
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of


class _Gemma(nn.Module):
    """A Gemma-style gain ``1 + w`` and a transposed weight, both parameter expressions."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.proj = nn.Linear(3, 2, bias=False)

    def forward(self, x):
        gain = 1.0 + self.w
        return (x * gain) @ self.proj.weight.t()


def _graph():
    model = _Gemma()
    graph = capture_graphs(model, torch.randn(4, 3))[0]
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    return model, graph, ParamEvaluator(graph.gm, graph.example_inputs, kinds)


def test_parameter_expressions_evaluate_to_their_live_values():
    model, graph, ev = _graph()
    nodes = list(graph.gm.graph.nodes)
    gain = next(n for n in nodes if op_of(n) == "add")
    t = next(n for n in nodes if op_of(n) == "t")
    torch.testing.assert_close(ev.evaluate(gain), 1.0 + model.w.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ev(t), model.proj.weight.detach().t(), rtol=0, atol=0)
    with torch.no_grad():                       # an optimizer step: the same tensor, new values
        model.w.mul_(-2.0)
    torch.testing.assert_close(ev.evaluate(gain), 1.0 + model.w.detach(), rtol=0, atol=0)
    assert not ev.evaluate(gain).requires_grad
    assert ev.kinds.is_param(gain)


def test_nodes_that_read_a_user_input_evaluate_to_none():
    _, graph, ev = _graph()
    nodes = list(graph.gm.graph.nodes)
    x = next(n for n in nodes if n.op == "placeholder" and ev.kinds.is_activation(n))
    product = next(n for n in nodes if op_of(n) == "mul")
    assert ev.evaluate(x) is None and ev.evaluate(product) is None
    matmul = next(n for n in nodes if op_of(n) == "matmul")
    assert ev.evaluate(matmul) is None
