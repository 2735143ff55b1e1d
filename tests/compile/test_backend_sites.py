"""``geoscale_fx.compile.backend_sites``: what the backend reads off a captured graph about a site —
the inputs by placeholder, the parameters a site reads (its owners), a
parameter's name in its model, the graph-wide context of planning and the site's device —
on a small attention captured here, checked against the module's own parameters by identity.
"""
from __future__ import annotations

import dataclasses
import gc
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

import geoscale_fx
from geoscale_fx.compile.backend_sites import (SiteRecord, global_heads, graph_context,
                                       placeholder_values, site_device, site_owners,
                                       symbolic_shapes, upstream_placeholders)
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import analyze_graph

B, L, D, H = 2, 5, 16, 2
DH = D // H
#: the parameters the logit bound reads: q and k and the normalization before them
LOGIT_PARAMS = {"norm.weight", "norm.bias", "q.weight", "q.bias", "k.weight", "k.bias"}


class Attention(nn.Module):
    """``sdpa(q(LN(x)), k(LN(x)), v(LN(x)))``; ``raw_query``: q projects x itself (no
    normalization: the analysis leaves the site unsupported)."""

    def __init__(self, raw_query: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.raw_query = raw_query

    def forward(self, x):
        h = self.norm(x)
        q = self.q(x if self.raw_query else h)
        q, k, v = (t.view(B, L, H, DH).transpose(1, 2) for t in (q, self.k(h), self.v(h)))
        out = F.scaled_dot_product_attention(q, k, v)                     # (B, H, L, dh)
        return out.transpose(1, 2).reshape(B, L, D)


def _captured(model, dynamic=False):
    (graph,) = capture_graphs(model, torch.randn(B, L, D), dynamic=dynamic)
    (site,) = analyze_graph(graph.gm, graph.example_inputs)
    return graph, site, placeholder_values(graph.gm, graph.example_inputs)


def _names_of(tensors, model) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id.get(id(t), "<not a parameter>") for t in tensors}


def test_placeholder_values_pair_each_placeholder_with_its_input():
    graph, _, values = _captured(Attention())
    placeholders = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    assert list(values) == placeholders
    assert all(values[n] is graph.example_inputs[i] for i, n in enumerate(placeholders))
    assert list(placeholder_values(graph.gm, graph.example_inputs[:2])) == placeholders[:2]


def test_upstream_placeholders_are_in_graph_order_whatever_the_order_asked():
    model = Attention()
    graph, site, values = _captured(model)
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    q_weight = next(n for n in placeholders if values[n.name] is model.q.weight)
    assert upstream_placeholders(graph.gm, [q_weight.name]) == [q_weight]
    # every input feeds the attention (x, the norm, q, k, v)
    assert upstream_placeholders(graph.gm, [site.node, "no_such_node"]) == placeholders
    asked = list(reversed(site.weight_nodes))
    found = upstream_placeholders(graph.gm, asked)
    assert found == [n for n in placeholders if n in found]
    assert _names_of([values[n.name] for n in found], model) == LOGIT_PARAMS


def test_a_site_is_owned_by_the_parameters_its_bound_reads():
    model = Attention()
    graph, site, values = _captured(model)
    assert site.supported, site.reason
    owners = site_owners(graph.gm, site, values)
    assert _names_of(owners.keys(), model) == LOGIT_PARAMS       # not v, not the input x


def test_an_unsupported_site_is_owned_by_every_parameter_upstream():
    model = Attention(raw_query=True)
    graph, site, values = _captured(model)
    assert not site.supported
    owners = site_owners(graph.gm, site, values)
    assert _names_of(owners.keys(), model) == {n for n, _ in model.named_parameters()}


def test_a_record_belongs_to_the_model_whose_parameters_it_reads():
    model, other = Attention(), Attention()
    graph, site, values = _captured(model)
    record = SiteRecord(site, None, None, site_owners(graph.gm, site, values))
    assert record.name == site.name                   # the site's own name unless qualified
    assert record.belongs_to(list(model.parameters()))
    assert not record.belongs_to(list(other.parameters()))
    assert not record.belongs_to([model.v.weight])


def test_one_backend_serving_two_models_keeps_their_sites_apart():
    """Two instances of one class through one backend: a record each, each owned by its own
    model's parameters only."""
    backend = geoscale_fx.backend(compiler="aot_eager")
    first, second = Attention(), Attention()
    x = torch.randn(B, L, D)
    with torch.no_grad():
        for model in (first, second):
            torch.compile(model, backend=backend)(x)
    records = list(backend.records.values())
    assert len(records) == 2
    owners = [(r.belongs_to(list(first.parameters())), r.belongs_to(list(second.parameters())))
              for r in records]
    assert owners == [(True, False), (False, True)]


def test_graph_context_reads_device_training_and_heads():
    """N = multiplicity × the supported sites' query heads, at least the heads seen."""
    model = Attention()
    graph, site, values = _captured(model)
    unsupported = _captured(Attention(raw_query=True))[1]
    with torch.no_grad():
        ctx = graph_context(graph.gm, [site, unsupported], values, n_heads_seen=0)
    assert (ctx.device, ctx.training, ctx.symbolic, ctx.n_heads_total) == ("cpu", False,
                                                                           False, H)
    assert graph_context(graph.gm, [site], values, 0).training        # grad on, params train
    assert graph_context(graph.gm, [site], values, 0, multiplicity=3).n_heads_total == 3 * H
    assert graph_context(graph.gm, [site], values, n_heads_seen=10).n_heads_total == 10


def test_symbolic_shapes_are_seen_in_a_dynamic_capture():
    static, _, _ = _captured(Attention())
    dynamic, _, _ = _captured(Attention(), dynamic=True)
    assert not symbolic_shapes(static.gm)
    assert symbolic_shapes(dynamic.gm)


def test_global_heads_count_every_tensor_parallel_rank():
    _, site, _ = _captured(Attention())
    assert global_heads(site) == H
    sharded = dataclasses.replace(site, shard=types.SimpleNamespace(n_q_heads=4 * H))
    assert global_heads(sharded) == 4 * H


def test_site_device_is_the_first_weights_else_any_inputs():
    _, site, values = _captured(Attention())
    first = site.weight_nodes[0]
    on_meta = {**values, first: values[first].to("meta")}
    assert site_device(on_meta, site) == torch.device("meta")
    no_weights = {"x": torch.empty(1, device="meta"), "n": 3}
    assert site_device(no_weights, site) == torch.device("meta")
    assert site_device({}, site) == torch.device("cpu")
