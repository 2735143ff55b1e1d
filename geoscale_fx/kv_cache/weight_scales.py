"""Certified per-layer q/k/v bounds of a model from its current weights (``WeightKVScales``).

The model is traced once with its cache in use and its cache writes marked
(``kv_cache_map.traced_with_writes``); the attention sites
(``analyze_graph``) and what each write stores (``analysis.forms.cache_writes``) give the cache
layers (``kv_cache_map.cache_layers``): per layer index the model writes, the bounds on
``max |entry|`` of what it stores (``amax.cache_write_bounds``: the attention's keys and
values, or an MLA layer's latent) and of the reading attention's queries
(``amax.site_amax_bounds``), per head, float64, for every input; ``LayerScales.scales``
turns them into FP8 (or NVFP4) k/v scales. Layers no attention writes (a hybrid's
linear-attention layers) have none. The bounds are re-evaluated from the live parameters
whenever one changed in place or moved to a new storage (``runtime.version_record``; tensors
made in inference mode keep no version counter: every call); a parameter or buffer replaced
by another tensor is found by name and the graphs are analysed again on it (never a second
forward pass). Parameters with inf/nan are refused by name before any bound is computed.

Used by the FP8 KV cache of ``generate`` (``geoscale_fx.kv_cache.manager``), by
``export_kv_scales`` and by ``attention_scales``::

    scales = WeightKVScales(model).capture(input_ids)    # one trace
    for layer in scales.layers():                        # per written cache layer, in order
        k_scale, v_scale = layer.scales("e4m3")          # float32 (stored heads,)
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from geoscale_fx.numerics import amax
from geoscale_fx.analysis.capture import CapturedGraph, capture_graphs
from geoscale_fx.kv_cache.layer_map import (
    CacheLayer, layer_scales, plan_cache_layers, traced_with_writes,
)
from geoscale_fx.kv_cache.refusals import LayerRefusal, with_remedy
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.analysis.forms.cache_writes import sites_and_cache_writes
from geoscale_fx.analysis.fx.dtensor import to_local
from geoscale_fx.analysis.fx.graph_ops import upstream
from geoscale_fx.core.errors import NonFiniteWeights, all_finite, non_finite_entries
from geoscale_fx.runtime.version_record import VersionRecord
from geoscale_fx.sites.model import CacheWrite

__all__ = ["WeightKVScales"]

log = logging.getLogger("geoscale_fx")


def _parameters_and_buffers(model: nn.Module) -> tuple[list, list]:
    """``(parameters, parameters + buffers)`` of ``model``, in its order."""
    parameters = list(model.parameters())
    return parameters, [*parameters, *model.buffers()]


def _tensor_names(model: nn.Module) -> dict[int, str]:
    """``id(tensor) -> name`` of every parameter and buffer (a tied one: its first name)."""
    out: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        out.setdefault(id(t), name)
    return out


def _reads(graph: CapturedGraph, node_names) -> list[int]:
    """Positions among ``graph``'s inputs of the parameters the nodes are computed from."""
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    reads = upstream([by_name[name] for name in node_names])
    return sorted(position[n] for n in reads if n in position)


def _layer_reads(graphs: list[CapturedGraph], layer: CacheLayer
                 ) -> list[tuple[str, int, list[int]]]:
    """``(site name, graph, input positions)`` of what the layer's bounds read."""
    parts = [(s.graph, [n for t in s.terms for n in t.q.node_names])
             for s in layer.sites + layer.readers]
    parts += [(w.graph, list(w.node_names)) for w in layer.writes]
    if not layer.writes:
        parts += [(s.graph, list(s.operand_nodes)) for s in layer.sites]
    return [(layer.site, g, _reads(graphs[g], nodes)) for g, nodes in parts]


class WeightKVScales:
    """Certified per-layer q/k/v bounds of ``model`` from its current weights.

    ``capture(*args, **kwargs)`` traces the model once (arguments as in a call of its class's
    ``forward``: a ``forward`` a client set on the instance, as TRL's trainers do, is not
    called; a Hugging Face model is traced with ``use_cache=True``, its cache writes marked); ``layers()`` evaluates
    the bounds of each cache layer it writes, again only when the parameters changed (an
    in-place update, a new storage, or a parameter replaced by another tensor of the same
    name: the traced graph is then re-analysed on the new tensors, without a forward pass).
    Every attention must be supported, every stored tensor traced to the weights, and every
    parameter the bounds read finite: otherwise a ``ValueError`` names the site or layer, the
    reason and its remedy, or the parameter (never a silent default scale). ``partial=True``
    (``export_kv_scales``' default, never the FP8 cache of ``generate``) leaves the refused
    cache layers out instead, with a warning (``kv_cache_map.CachePlan.settle``), and lists
    them in ``refused``; ``who`` prefixes the refusals.
    """

    def __init__(self, model: nn.Module, *, partial: bool = False, who: str = "kv_cache"):
        self.model = model
        self.partial = partial
        self.who = who
        self.refused: tuple[LayerRefusal, ...] = ()   # the plan's refusals (partial only)
        self._graphs: Optional[list[CapturedGraph]] = None
        self._names: list[dict[int, str]] = []      # per graph: input position -> tensor name
        self._sites: Optional[list] = None
        self._cache_layers: list[CacheLayer] = []
        self._reads: list[tuple[str, int, list[int]]] = []  # (site, graph, input positions)
        #: the parameters and buffers the traced graphs read (which objects only: another
        #: one is a rebind), and the parameters the bounds were evaluated from (versions and
        #: storage too). Buffers' contents are left out: geoscale's own state, updated by
        #: every compiled call, would otherwise force a recomputation each time.
        self._bound_to, self._evaluated = VersionRecord(), VersionRecord()
        self._layers: Optional[list[LayerScales]] = None

    @property
    def captured(self) -> bool:
        return self._sites is not None

    def capture(self, *args, **kwargs) -> "WeightKVScales":
        # the model as its class defines it (``capture_graphs``): not apply_'s compiled
        # call, nor a forward a client set on the instance
        graphs = traced_with_writes(lambda kw: capture_graphs(self.model, *args, **kw),
                                    self.model, kwargs, self.who)
        names = _tensor_names(self.model)
        self._graphs = graphs
        self._names = [{i: names[id(v)] for i, v in enumerate(g.example_inputs)
                        if id(v) in names} for g in graphs]
        self._analyze()
        self._bound_to.update(_parameters_and_buffers(self.model)[1])
        self._evaluated = VersionRecord()
        log.info("geoscale: %s: %d cache layers of %d attention sites traced for k/v scales",
                 self.who, len(self._cache_layers), len(self._sites))
        return self

    def _analyze(self) -> None:
        sites, writes = sites_and_cache_writes(self._graphs)
        if not sites:
            raise ValueError(with_remedy(f"{self.who}: no attention found in "
                                         f"{type(self.model).__name__}"))
        plan = plan_cache_layers(self.model, sites, writes, self.who)
        plan.settle(self.who, self.partial)
        layers = list(plan.layers)
        self.refused = plan.refused
        self._sites, self._cache_layers, self._layers = sites, layers, None
        self._reads = [r for layer in layers for r in _layer_reads(self._graphs, layer)]

    def layers(self) -> list[LayerScales]:
        """Per cache layer, in layer order; recomputed only if a parameter changed."""
        if self._sites is None:
            raise RuntimeError("WeightKVScales.capture(...) must run before layers()")
        parameters, tensors = _parameters_and_buffers(self.model)
        if not self._bound_to.same(tensors):
            self._rebind()
            self._bound_to.update(tensors)
        elif self._layers is not None and self._evaluated.holds(parameters,
                                                                 range(len(parameters))):
            return self._layers
        self._check_finite()
        self._layers = self._evaluate()
        self._evaluated.update(parameters)
        return self._layers

    def _rebind(self) -> None:
        """Parameters replaced by new tensors (``load_state_dict(assign=True)``, a new
        ``nn.Parameter``): put the live ones, by name, into the traced graphs' inputs and
        analyse again (the sites' resolvers read those inputs)."""
        live = dict(self.model.named_parameters(remove_duplicate=False))
        live.update(self.model.named_buffers(remove_duplicate=False))
        replaced = 0
        for graph, names in zip(self._graphs, self._names):
            for i, name in names.items():
                if name not in live:
                    raise ValueError(f"{self.who}: {name!r}, read by the traced model, is no "
                                     f"longer in {type(self.model).__name__}; capture again")
                if live[name] is not graph.example_inputs[i]:
                    graph.example_inputs[i] = live[name]
                    replaced += 1
        if replaced:
            log.info("geoscale: kv_cache: %d parameters replaced by new tensors; the traced "
                     "graphs are analysed again on them (no forward pass)", replaced)
            self._analyze()

    def _check_finite(self) -> None:
        """Raise ``NonFiniteWeights`` naming the first site and parameter holding inf/nan,
        before any bound is computed (an eigensolver given NaN raises a bare
        ``LinAlgError``). ``all_finite`` screens them with one sum per tensor (a few ms less
        per refresh than ``isfinite``); only then is a tensor looked at entry by entry."""
        reads = [(site, index, i, to_local(self._graphs[index].example_inputs[i]))
                 for site, index, positions in self._reads for i in positions]
        reads = [r for r in reads if isinstance(r[3], torch.Tensor)
                 and r[3].is_floating_point() and r[3].device.type != "meta"]
        if all_finite([value for *_, value in reads]):
            return
        for site, index, i, value in reads:
            bad = non_finite_entries(value)
            if bad:
                name = self._names[index].get(i, f"graph input {i}")
                raise NonFiniteWeights(
                    f"geoscale: attention site {site!r}: parameter {name!r} is not "
                    f"finite ({bad} inf/nan value(s) out of {value.numel()}); its q/k/v "
                    "bounds (and FP8 scales) would be NaN")

    def _evaluate(self) -> list[LayerScales]:
        def q_of(site):
            return amax.site_amax_bounds(site, roles="q")["q"]

        def kv_of(part):
            if isinstance(part, CacheWrite):
                return amax.cache_write_bounds(part)
            return amax.site_amax_bounds(part, roles="kv")

        return [layer_scales(layer, q_of, kv_of, self.who) for layer in self._cache_layers]
