"""geoscale_fx.analysis.fx.graph_ops: one canonical name per spelling, argument access, constants,
and which nodes are parameter-only, on symbolic traces and a Dynamo capture."""
from __future__ import annotations


import operator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import symbolic_trace

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.fx.module_names import graph_names
from geoscale_fx.analysis.fx.graph_ops import (
    ValueKinds, arg, op_of, parameter_name, scalar_constant, upstream,
)


def _ops(fn) -> list:
    gm = symbolic_trace(fn)
    return [op_of(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_each_spelling_maps_to_one_name():
    def spellings(x, w):
        a = F.linear(x, w)
        b = torch._C._nn.linear(x, w)
        c = a.transpose(0, 1) + torch.transpose(b, 0, 1)
        d = operator.mul(c, 2) * c.mul(3)
        e = torch.softmax(d, -1) @ d.float().matmul(d)
        return torch.cumsum(e, 0)

    assert _ops(spellings) == ["linear", "linear", "transpose", "transpose", "add", "mul",
                               "mul", "mul", "softmax", "cast", "matmul", "matmul", None]


def test_arg_upstream_and_scalar_constants():
    def fn(x):
        y = torch.softmax(x * 0.5, dim=-1)
        return y + x

    gm = symbolic_trace(fn)
    nodes = {n.name: n for n in gm.graph.nodes}
    softmax, mul, add = nodes["softmax"], nodes["mul"], nodes["add"]
    assert arg(softmax, 1, "dim") == -1 and arg(softmax, 2, "dtype", "none") == "none"
    assert [n.name for n in upstream([add])] == ["add", "x", "softmax", "mul"]
    assert [n.name for n in upstream([add], follow=lambda n: n.name != "softmax")] == [
        "add", "x", "softmax"]
    assert [n.name for n in upstream([add], depth=1)] == ["add", "x", "softmax"]   # mul: 2
    assert scalar_constant(mul.args[1]) == 0.5 and scalar_constant(True) is None
    assert scalar_constant(mul) is None                 # a tensor, not a number


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x):
        w = self.inner[1].weight.t() * 2.0                  # a parameter expression
        return self.inner(x) + x @ w + self.table * 3.0


def test_value_kinds_and_parameter_names_on_a_dynamo_graph():
    graph = capture_graphs(_Tiny(), torch.randn(2, 4))[0]
    g = graph.gm.graph
    graph_names(graph.gm, graph.example_inputs).annotate(graph.gm)
    kinds = ValueKinds(g, graph.example_inputs)
    by_name = {parameter_name(n): n for n in g.nodes if n.op == "placeholder"}
    assert set(by_name) >= {"inner.0.weight", "inner.0.bias", "inner.1.weight", "table"}
    assert all(kinds.is_param(by_name[k]) for k in ("inner.1.weight", "table"))
    x = next(n for n in g.nodes if n.op == "placeholder" and not kinds.is_param(n))
    assert kinds.is_activation(x) and not kinds.is_param(x)
    t = next(n for n in g.nodes if op_of(n) == "t")
    assert kinds.is_param(t) and kinds.is_param(next(iter(t.users)))   # w.t() * 2.0
    output = next(n for n in g.nodes if n.op == "output")
    assert kinds.is_activation(output.args[0][0] if isinstance(output.args[0], tuple)
                               else output.args[0])
    assert not kinds.is_param(None) and not kinds.is_constant(x)


