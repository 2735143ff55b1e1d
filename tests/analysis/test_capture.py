"""geoscale_fx.analysis.capture: ``capture_graphs`` records what Dynamo hands a backend and runs it as
Dynamo would, tracing a module as its class defines it; ``find_attention`` numbers sites
across graph breaks."""
from __future__ import annotations

import types

import torch
import torch.nn as nn

import geoscale_fx
from geoscale_fx.analysis.capture import capture_graphs, find_attention
from geoscale_fx.compile.attach import geoscale_call
from tests.attention_variants import Block, QueryIsInput

D = 64


class TwoBlocksWithABreak(nn.Module):
    """Two attention blocks with a graph break between them: two Dynamo graphs."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Block(), Block(norm="rmsnorm")

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def test_capture_runs_the_graph_and_leaves_the_model_as_it_was():
    model = Block().eval()
    x = torch.randn(2, 5, D)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graphs = capture_graphs(model, x)
    assert len(graphs) == 1
    gm, inputs = graphs[0].gm, graphs[0].example_inputs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(inputs) == len(placeholders)
    # the parameters are graph inputs (placeholders), the live tensors themselves
    param_ids = {id(p) for p in model.parameters()}
    assert sum(id(t) in param_ids for t in inputs) == len(param_ids)
    torch.testing.assert_close(gm(*inputs)[0], model(x))             # replay == eager
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not hasattr(model, "_orig_mod") and model._compiled_call_impl is None


def test_static_shapes_by_default():
    graphs = capture_graphs(Block().eval(), torch.randn(3, 7, D))
    x = next(n for n in graphs[0].gm.graph.nodes if n.op == "placeholder"
             and tuple(n.meta["example_value"].shape) == (3, 7, D))
    assert all(isinstance(s, int) for s in x.meta["example_value"].shape)


def test_a_graph_break_gives_two_graphs_and_sites_numbered_across_them():
    model = TwoBlocksWithABreak().eval()
    assert len(capture_graphs(model, torch.randn(1, 4, D))) == 2
    torch._dynamo.reset()
    sites = find_attention(model, torch.randn(1, 4, D))
    assert [(s.name, s.graph, s.index, s.norm) for s in sites] == [
        ("first", 0, 0, "layernorm"), ("second", 1, 1, "rmsnorm")]
    assert all(s.supported for s in sites)


def test_a_look_alike_over_normalized_vectors_is_bounded_by_their_norm():
    """softmax(h hᵀ) h with h = LayerNorm(x): no projection, but ‖h‖ is bounded by the norm,
    so the site is supported with identity sides (``analysis/norms/bounded_operand.py``)."""
    sites = find_attention(QueryIsInput().eval(), torch.randn(1, 4, D))
    assert len(sites) == 1 and sites[0].supported, sites[0].reason
    assert sites[0].q.weight is None and sites[0].q.source.norm == "layernorm"


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Block(), Block()

    def forward(self, x):
        return self.second(self.first(x))


def test_a_forward_set_on_the_instance_is_not_what_is_traced():
    """A client's wrapper set as the instance's ``forward`` (TRL's fused LM head: keyword-only
    arguments only its own call supplies) is never called by a capture: the class's forward
    is traced, under the model's own names, and the wrapper is the model's again after."""
    model = TwoBlocks().eval()
    calls = []

    def wrapper(self, x, *, fused_head):           # no default: ids alone would raise
        calls.append(fused_head)
        return type(self).forward(self, x)

    model.forward = types.MethodType(wrapper, model)
    routed = model.__dict__["forward"]
    sites = find_attention(model, torch.randn(1, 4, D))
    assert [(s.name, s.supported) for s in sites] == [("first", True), ("second", True)]
    assert calls == [] and model.__dict__["forward"] is routed
    model(torch.randn(1, 4, D), fused_head=True)    # the wrapper still serves real calls
    assert calls == [True]


def test_a_forward_only_the_instance_defines_is_traced():
    """A module whose class defines no ``forward`` (set in its constructor) is traced
    through the instance's."""
    class Assigned(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.forward = types.MethodType(lambda self, x: self.block(x) * 2, self)

    sites = find_attention(Assigned().eval(), torch.randn(1, 4, D))
    assert [s.name for s in sites] == ["block"] and "forward" in Assigned().__dict__


def test_a_converted_model_is_traced_plain_and_counts_no_call():
    """``apply_``'s compiled call is left out of a capture: the model is not compiled with
    geoscale inside the recorder, and its call counts nothing (it used to count an eager
    call, and warn that the model ran without FP8)."""
    model = TwoBlocks().eval()
    geoscale_fx.apply_(model, compiler="eager")
    call = geoscale_call(model)
    sites = find_attention(model, torch.randn(1, 4, D))
    assert [s.name for s in sites] == ["first", "second"]
    assert (call.calls, call.eager_calls, call.backend.compiles) == (0, 0, 0)
    assert model._compiled_call_impl is call
    model(torch.randn(1, 4, D))
    assert (call.calls, call.eager_calls) == (1, 0) and len(call.backend.records) == 2
