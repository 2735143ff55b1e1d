"""The analysis pass: every attention site of a GraphModule, traced back to its weights.

``analyze_graph(gm, example_inputs)`` is what both ``geoscale_fx.find_attention`` and the
backend run on the graph Dynamo captured. It never modifies ``gm``.

Each candidate ``find_sites`` returns goes to the analyzer of its kind (``ANALYZERS``): a
function ``(Candidate, ValueKinds, evaluator, NodeOrder) -> dict`` of ``AttentionSite``
fields, or ``Unsupported`` whose message — naming the graph node — becomes the site's
``reason``. Such a site of a kind whose q and k are named (``MEASURABLE``) carries in
``measured`` the same site bounded by its operands' norms measured at every call
(``analysis.forms.measured_sites``), which planning runs; otherwise it is left in high precision.
A new attention form is a new kind in ``find_sites`` and one entry here.

A site is named by its module's path in the model the graph was captured from, found by
identity (``analysis.fx.module_names``: the graph's parameters and its module calls), never
from how Dynamo reached the model; a graph with no model names its sites by their node.

Example::

    for i, g in enumerate(capture_graphs(model, x)):    # geoscale_fx.analysis.capture: Dynamo's graphs
        for site in analyze_graph(g.gm, g.example_inputs, graph_index=i):
            print(site.name, site.supported, site.reason or site.n_q_heads)
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch.fx import GraphModule

from geoscale_fx.analysis.fx.dtensor import to_local
from geoscale_fx.analysis.evaluate import ParamEvaluator
from geoscale_fx.analysis.forms.find_sites import find_candidates
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.forms.measured_sites import measured_fields
from geoscale_fx.analysis.fx.module_names import graph_names
from geoscale_fx.analysis.forms.opaque_attention import analyze_encoder_layer, analyze_mha
from geoscale_fx.analysis.sides.traced_operands import analyze_operands
from geoscale_fx.sites.model import ROPE_BOUNDS, AttentionSite

__all__ = ["analyze_graph", "NodeOrder", "ANALYZERS"]

log = logging.getLogger("geoscale_fx")

#: The analyzer of each candidate kind ``find_sites`` reports.
ANALYZERS = {
    "sdpa": analyze_operands,
    "explicit": analyze_operands,
    "mha": analyze_mha,
    "encoder_layer": analyze_encoder_layer,
}

#: candidate kinds whose q and k operands are named: when the weights cannot bound them,
#: their measured norms can (``analysis.forms.measured_sites``)
MEASURABLE = ("sdpa", "explicit")


def analyze_graph(gm: GraphModule, example_inputs: Sequence[Any], *, graph_index: int = 0,
                  first_index: int = 0, rope_bound: str = "norm_product",
                  weak_inputs: bool = False) -> list[AttentionSite]:
    """Find and analyse every attention in ``gm`` (a Dynamo graph: params are placeholders).
    ``weak_inputs``: the sites read the parameters through weak references (the backend's
    records must not keep a deleted model's parameters alive)."""
    if rope_bound not in ROPE_BOUNDS:
        raise ValueError(f"rope_bound must be one of {ROPE_BOUNDS}, got {rope_bound!r}")
    names = graph_names(gm, example_inputs)
    names.annotate(gm)
    kinds = ValueKinds(gm.graph, example_inputs)
    evaluator = ParamEvaluator(gm, example_inputs, kinds, weak=weak_inputs)
    order = NodeOrder(gm.graph)
    by_name = order.by_name

    def resolve(name: str) -> torch.Tensor:
        value = evaluator.evaluate(by_name[name])
        if value is None:
            raise ValueError(f"graph node {name!r} is not a function of the parameters")
        return to_local(value)   # tensor parallel: sites index the rank's local shards

    sites = []
    for i, cand in enumerate(find_candidates(gm.graph, kinds)):
        base = dict(name=names.module(cand.node) or cand.node.name, index=first_index + i,
                    kind=cand.kind, node=cand.node.name, graph=graph_index,
                    rope_bound=rope_bound,
                    nodes=tuple((role, n.name) for role, n in cand.roles.items()),
                    score_op=op_of(cand.roles["scores"]) if "scores" in cand.roles else "")
        try:
            if cand.failure:
                raise Unsupported(cand.failure)
            fields = ANALYZERS[cand.kind](cand, kinds, evaluator, order)
            site = AttentionSite(**base, supported=True, _resolve=resolve, **fields)
        except Unsupported as exc:
            measured = _measured(cand, kinds, exc, base, resolve)
            site = AttentionSite(**base, supported=False, reason=str(exc),
                                 is_causal=cand.is_causal, has_mask=cand.has_mask,
                                 measured=measured)
            if measured is None:
                log.info("geoscale: attention %s (%s) left as is: %s", site.name, site.node,
                         site.reason)
            else:
                log.info("geoscale: attention %s (%s) is bounded by its measured q and k: "
                         "%s", site.name, site.node, site.reason)
        sites.append(site)
    return sites


def _measured(cand, kinds, why: Unsupported, base: dict, resolve) -> AttentionSite | None:
    """The site bounded by its operands' measured norms (``analysis.forms.measured_sites``), for
    the kinds whose operands are named and a softmax that is attention (no ``failure``)."""
    if cand.kind not in MEASURABLE or cand.failure:
        return None
    try:
        fields = measured_fields(cand, kinds, why)
    except Unsupported as exc:
        log.debug("geoscale: %s not measured either: %s", cand.node.name, exc)
        return None
    return AttentionSite(**base, supported=True, _resolve=resolve, **fields)


class NodeOrder(dict):
    """Position of every node of a graph, and its nodes by name (built once per graph)."""

    def __init__(self, graph):
        super().__init__((n, i) for i, n in enumerate(graph.nodes))
        self.by_name = {n.name: n for n in self}
