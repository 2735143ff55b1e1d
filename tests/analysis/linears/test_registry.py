"""analysis.linears.registry: one question per opaque call, answered once per signature."""
from __future__ import annotations

import torch

from geoscale_fx.analysis.linears import registry
from geoscale_fx.analysis.linears.registry import (
    LINEAR_KINDS, low_precision_linear, unrecognized_cast,
)
from tests.float8_linears import Recipe, captured_call


def test_a_fp8_linear_is_found_once_per_signature(monkeypatch):
    registry._answers.clear()
    traced = []
    original = registry.traced_call
    monkeypatch.setattr(registry, "traced_call", lambda s: traced.append(1) or original(s))
    _, kinds, node = captured_call(Recipe(rows=True, emulate=True))
    found = low_precision_linear(node, kinds)
    assert (found.x, found.weight) == (node.args[0], node.args[1])
    assert found.cast.input.groups == "rows" and unrecognized_cast(node, kinds) is None
    _, kinds2, node2 = captured_call(Recipe(rows=True, emulate=True))   # a new graph, same call
    assert low_precision_linear(node2, kinds2).cast == found.cast
    assert len(traced) == 1
    _, kinds3, node3 = captured_call(Recipe())                  # another recipe: traced again
    assert low_precision_linear(node3, kinds3).cast.input.groups == "tensor"
    assert len(traced) == 2


def test_a_cast_in_no_known_form_is_refused_naming_the_call():
    _, kinds, node = captured_call(Recipe(input_scale="static"))
    assert low_precision_linear(node, kinds) is None
    reason = unrecognized_cast(node, kinds)
    assert f"`{node.name}` (_Float8Matmul)" in reason and "FP8 casts" in reason


def test_every_kind_is_a_function_of_a_traced_call():
    assert len(LINEAR_KINDS) == 2 and all(callable(k) for k in LINEAR_KINDS)
    assert low_precision_linear.__module__ == registry.__name__
    assert torch.float8_e4m3fn in registry.FP8_STORAGE


@torch._dynamo.allow_in_graph
def _opaque_product(x, w):
    return x @ w.t()


@torch._dynamo.allow_in_graph
def _opaque_scale(x):
    return x * 2


class _Calls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return _opaque_product(x, self.w), _opaque_scale(x)


def test_an_opaque_product_is_refused_an_opaque_elementwise_call_is_not():
    from geoscale_fx.analysis.capture import capture_graphs
    from geoscale_fx.analysis.fx.graph_ops import ValueKinds

    (graph,) = capture_graphs(_Calls(), torch.randn(2, 16))
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    product, = [n for n in graph.gm.graph.nodes if n.target is _opaque_product]
    scale, = [n for n in graph.gm.graph.nodes if n.target is _opaque_scale]
    assert low_precision_linear(product, kinds) is None
    assert "computes a matrix product that is no projection" in unrecognized_cast(product, kinds)
    assert unrecognized_cast(scale, kinds) is None and low_precision_linear(scale, kinds) is None
