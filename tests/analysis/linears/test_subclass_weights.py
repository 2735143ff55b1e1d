"""analysis.linears.subclass_weights: a matmul by a tensor-subclass weight is no projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import Graph

from geoscale_fx.analysis.linears.subclass_weights import subclass_weight


class _Wrapped(torch.Tensor):
    """Stands for a weight wrapper whose dispatch computes the product its own way."""


def _linear(weight_value: torch.Tensor, transposed: bool = False):
    graph = Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["example_value"] = torch.randn(2, 4)
    w.meta["example_value"] = weight_value
    if transposed:           # matmul(x, W.t()): the walk back goes through the transpose
        return graph.call_function(torch.matmul, (x, graph.call_method("t", (w,))))
    return graph.call_function(F.linear, (x, w))


def test_a_subclass_weight_is_refused_by_name_a_plain_one_is_not():
    wrapped = torch.randn(3, 4).as_subclass(_Wrapped)
    for transposed in (False, True):
        reason = subclass_weight(_linear(wrapped, transposed))
        assert "multiplies by `w`, a _Wrapped (a tensor subclass" in reason
    assert subclass_weight(_linear(torch.randn(3, 4))) is None
    assert subclass_weight(_linear(torch.nn.Parameter(torch.randn(3, 4)))) is None
    graph = Graph()
    add = graph.call_function(torch.add, (graph.placeholder("a"), graph.placeholder("b")))
    assert subclass_weight(add) is None                       # not a matmul
