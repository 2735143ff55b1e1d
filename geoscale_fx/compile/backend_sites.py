"""What the backend reads off a captured graph about its sites: records, owners, context.

Which model a site belongs to is decided by the parameter tensors it reads (``site_owners``,
held weakly in a ``SiteRecord``); its name in the model by identity (``analysis.fx.module_names``).
``graph_context`` gives the plan the graph-wide facts it needs (device, training, symbolic
shapes, N = the heads of every site, over every tensor-parallel rank: ``global_heads``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Node
from torch.utils.weak import WeakIdKeyDictionary

from geoscale_fx.analysis.fx.graph_ops import example_value, upstream
from geoscale_fx.planning.plan import GraphContext, SitePlan
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.state import SiteState

__all__ = ["SiteRecord", "placeholder_values", "upstream_placeholders",
           "site_owners", "graph_context", "global_heads", "symbolic_shapes", "site_device"]


@dataclass
class SiteRecord:
    """What the backend did with one site (for ``report``)."""
    site: AttentionSite
    plan: SitePlan | None
    state: SiteState | None
    #: the parameter tensors the site reads (weakly held): which model it belongs to
    owners: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary, repr=False)
    note: str = ""
    name: str = ""            # qualified site name (per-block compile: the block's path)

    def __post_init__(self):
        self.name = self.name or self.site.name
        #: whether it read parameters at all: a record whose parameters were all freed
        #: belongs to a deleted model (``GeoscaleBackend.forget_freed``)
        self.had_owners = bool(len(self.owners))

    def belongs_to(self, params: Sequence[torch.Tensor]) -> bool:
        return any(p in self.owners for p in params)


def placeholder_values(gm: GraphModule, example_inputs) -> dict[str, Any]:
    """``{placeholder name: its input}`` for the inputs given (in placeholder order)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n.name: example_inputs[i] for i, n in enumerate(placeholders)
            if i < len(example_inputs)}


def upstream_placeholders(gm: GraphModule, names: Sequence[str]) -> list[Node]:
    """The placeholders the named nodes are computed from, in graph order."""
    by_name = {n.name: n for n in gm.graph.nodes}
    found = [n for n in upstream(by_name[n] for n in names if n in by_name)
             if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(found, key=order.__getitem__)     # graph order: the same in every graph


def site_owners(gm: GraphModule, site: AttentionSite, values: dict) -> WeakIdKeyDictionary:
    """The parameters a site reads: its weight expressions' inputs, or (sites the analysis
    could not trace) every parameter upstream of the attention node."""
    roots = site.parameter_nodes if site.supported else (site.node,)
    owners = WeakIdKeyDictionary()
    for node in upstream_placeholders(gm, roots):
        value = values.get(node.name)
        if isinstance(value, torch.nn.Parameter) or (
                isinstance(value, torch.Tensor) and site.supported):
            owners[value] = True
    return owners


def graph_context(gm: GraphModule, sites, values: dict, n_heads_seen: int,
                   multiplicity: int = 1) -> GraphContext:
    """The graph-wide facts ``plan_site`` reads; N counts ``multiplicity`` copies of this
    graph's heads (one graph serving several blocks), at least ``n_heads_seen``."""
    tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
    device = next((t.device.type for t in tensors if t.is_floating_point()), "cpu")
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    n_total = max(multiplicity * sum(global_heads(s) for s in sites if s.supported),
                  n_heads_seen)
    return GraphContext(device=device, training=training, symbolic=symbolic_shapes(gm),
                        n_heads_total=n_total)


def global_heads(site: AttentionSite) -> int:
    """Query heads of a site over all tensor-parallel ranks (N of alpha="theory")."""
    return site.shard.n_q_heads if site.shard is not None else site.n_q_heads


def symbolic_shapes(gm: GraphModule) -> bool:
    """Whether Dynamo gave this graph symbolic (dynamic) shapes."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = example_value(node)
        if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in value.shape)):
            return True
    return False


def site_device(values: dict, site: AttentionSite) -> torch.device:
    """Where the site's state lives: the device of its first weight input (else any input's)."""
    for name in site.weight_nodes:
        value = values.get(name)
        if isinstance(value, torch.Tensor):
            return value.device
    tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")
