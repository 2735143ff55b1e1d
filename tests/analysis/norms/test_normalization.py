"""geoscale_fx.analysis.norms.normalization: ``norm_input``, ``same_value`` and refusals of
``trace_normalized_input`` (its positive forms are in tests/analysis/sides/test_provenance.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.norms.normalization import (
    norm_input, same_value, strip_casts, trace_normalized_input,
)

D = 8


class _Proj(nn.Module):
    """``proj(prepare(x))``: the projection's input is whatever ``prepare`` makes."""

    def __init__(self, prepare):
        super().__init__()
        self.prepare, self.proj = prepare, nn.Linear(D, D)
        self.gain = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x):
        return self.proj(self.prepare(self, x))


def _trace(prepare):
    graph = capture_graphs(_Proj(prepare), torch.randn(2, 5, D))[0]
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    linear = next(n for n in graph.gm.graph.nodes if op_of(n) == "linear")
    return graph.gm.graph, linear, kinds


def _hand_layernorm(self, x):
    xc = x - x.mean(-1, keepdim=True)
    return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-5)).float() * self.gain


def test_a_hand_written_layernorm_normalizes_x_not_the_centered_copy():
    graph, linear, kinds = _trace(_hand_layernorm)
    found = trace_normalized_input(linear.args[0], kinds, linear)
    assert (found.norm, found.model_dim, found.radius_factor) == ("layernorm", D, 1.0)
    assert [(k, v.name) for k, v in found.channel_ops] == [("mul", "l_self_parameters_gain_")]
    x = next(n for n in graph.nodes if n.op == "placeholder" and kinds.is_activation(n))
    assert norm_input(found.node) is x
    layer_norm = _trace(lambda self, x: F.layer_norm(x, (D,)))
    assert norm_input(next(n for n in layer_norm[0].nodes if op_of(n) == "layer_norm")).op \
        == "placeholder"


def test_division_by_a_constant_after_the_norm_is_a_gain():
    _, linear, kinds = _trace(lambda self, x: F.rms_norm(x, (D,)).to(torch.float32) / 4.0)
    found = trace_normalized_input(linear.args[0], kinds, linear)
    assert found.norm == "rmsnorm" and found.channel_ops == (("mul", 0.25),)


@pytest.mark.parametrize("prepare, reason", [
    (lambda self, x: F.layer_norm(x, (5, D)), r"`layer_norm`: layer_norm over \(5, 8\) does "
                                              "not bound each token's vector"),
    (lambda self, x: F.layer_norm(x, (D,)) * x, "no normalization before the projection "
                                                "`linear`: reached `mul`"),
    (lambda self, x: F.layer_norm(x, (D,)).flip(-1).sum(0, keepdim=True).expand(2, 5, D),
     "no normalization before the projection `linear`"),
])
def test_refusals_name_the_node(prepare, reason):
    _, linear, kinds = _trace(prepare)
    with pytest.raises(Unsupported, match=reason):
        trace_normalized_input(linear.args[0], kinds, linear)


def test_same_value_and_strip_casts():
    graph, linear, kinds = _trace(_hand_layernorm)
    nodes = list(graph.nodes)
    means = [n for n in nodes if op_of(n) == "mean"]
    assert len(means) == 2 and not same_value(means[0], means[1])     # mean(x) vs mean(xc²)
    x = next(n for n in nodes if n.op == "placeholder" and kinds.is_activation(n))
    assert same_value(x, x) and same_value(0.5, 0.5) and not same_value(0.5, 0.25)
    twice, _, _ = _trace(lambda self, x: (x - x.mean(-1, keepdim=True))
                         * (x - x.mean(-1, keepdim=True)))     # x − μ written twice
    subs = [n for n in twice.nodes if op_of(n) == "sub"]
    assert len(subs) == 2 and subs[0] is not subs[1] and same_value(subs[0], subs[1])
    cast = next(n for n in nodes if op_of(n) == "cast")
    assert strip_casts(cast) is cast.args[0] and strip_casts(x) is x
