"""analysis.linears.opaque_calls: an allow_in_graph call traced to ATen, nothing computed."""
from __future__ import annotations

import operator

import torch

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from geoscale_fx.analysis.linears.aten_chains import A
from geoscale_fx.analysis.linears.opaque_calls import call_name, call_signature, traced_call
from tests.float8_linears import Recipe, captured_call


def test_the_fp8_linear_call_is_traced_with_its_constant_recipe():
    recipe = Recipe(pow2=True)
    graph, kinds, node = captured_call(recipe)
    signature = call_signature(node, kinds)
    assert [n.name for n in signature.tensors] == [node.args[0].name, node.args[1].name]
    assert signature.specs == (((2, 4, 16), torch.float32, torch.device("cpu")),
                               ((16, 8), torch.float32, torch.device("cpu")))
    assert recipe in signature.args                    # the graph's Recipe(...) node, evaluated
    traced = traced_call(signature)
    targets = [n.target for n in traced.graph.graph.nodes if n.op == "call_function"]
    assert A._scaled_mm.default in targets and A.log2.default in targets
    assert traced.tensor_args == signature.tensors
    placeholders = [n for n in traced.graph.graph.nodes if n.op == "placeholder"]
    assert traced.argument(placeholders[1]) is node.args[1]
    assert call_name(node.target) == "_Float8Matmul"
    # keyed by value: another recipe is another key, the same recipe the same
    _, other_kinds, other_node = captured_call(Recipe())
    assert call_signature(other_node, other_kinds).key != signature.key
    assert call_signature(node, kinds).key == signature.key


class _Scaled(torch.nn.Module):
    """An opaque call (allow_in_graph) that reads a non-constant scalar: not traced."""

    def forward(self, x, n: int):
        return _double(x) * n


@torch._dynamo.allow_in_graph
def _double(x):
    return x * 2


def test_known_ops_and_calls_that_compute_no_fp8_are_told_apart():
    (graph,) = capture_graphs(torch.nn.Linear(4, 4), torch.randn(2, 4))
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    assert all(call_signature(n, kinds) is None for n in graph.gm.graph.nodes)  # F.linear
    (graph,) = capture_graphs(_Scaled(), torch.randn(2, 4), 3)
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    calls = [n for n in graph.gm.graph.nodes if n.target is _double]
    assert len(calls) == 1
    traced = traced_call(call_signature(calls[0], kinds))
    assert [n.target for n in traced.graph.graph.nodes if n.op == "call_function"] == \
        [A.mul.Tensor]
    muls = [n for n in graph.gm.graph.nodes if n.target is operator.mul]
    assert muls and call_signature(muls[0], kinds) is None     # an operator, not opaque
