"""The analysis driver: one analyzer per candidate kind; a refusal becomes the site's reason."""
import pytest
import torch
import torch.nn.functional as F

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import ANALYZERS, NodeOrder, analyze_graph
from geoscale_fx.analysis.forms.opaque_attention import analyze_encoder_layer, analyze_mha
from geoscale_fx.analysis.sides.traced_operands import analyze_operands


def _graph(fn, *args):
    (graph,) = capture_graphs(fn, *args)
    return graph


def _qkv():
    return [torch.randn(2, 3, 5, 8) for _ in range(3)]


def test_every_kind_find_sites_reports_has_its_analyzer():
    assert ANALYZERS == {"sdpa": analyze_operands, "explicit": analyze_operands,
                         "mha": analyze_mha, "encoder_layer": analyze_encoder_layer}


def test_a_softmax_outside_the_normal_form_is_a_site_whose_reason_is_the_failure():
    graph = _graph(lambda q, k, v: F.softmax(q @ k.transpose(-2, -1), dim=-2) @ v, *_qkv())
    (site,) = analyze_graph(graph.gm, graph.example_inputs, graph_index=3, first_index=7)
    assert (site.supported, site.kind, site.graph, site.index) == (False, "explicit", 3, 7)
    assert site.reason.endswith("but the softmax is not over the last dim of the scores; "
                                "left in high precision")


def test_operands_that_are_no_projection_are_refused_and_keep_the_flags():
    graph = _graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   *_qkv())
    (site,) = analyze_graph(graph.gm, graph.example_inputs)
    assert not site.supported and site.reason
    assert site.is_causal and dict(site.nodes) == {"attention": site.node}


def test_an_unknown_rope_bound_is_a_value_error_naming_the_choices():
    graph = _graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *_qkv())
    with pytest.raises(ValueError, match="rope_bound must be one of"):
        analyze_graph(graph.gm, graph.example_inputs, rope_bound="tight")


def test_node_order_numbers_nodes_and_finds_them_by_name():
    graph = _graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *_qkv())
    order = NodeOrder(graph.gm.graph)
    nodes = list(graph.gm.graph.nodes)
    assert [order[n] for n in nodes] == list(range(len(nodes)))
    assert all(order.by_name[n.name] is n for n in nodes)
