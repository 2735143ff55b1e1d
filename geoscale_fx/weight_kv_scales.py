"""Certified per-layer q/k/v bounds of a model from its current weights (``WeightKVScales``).

The attention sites of one trace of the model (``capture_graphs`` and ``analyze_graph``,
without a cache, so the keys are traced to their projection) are mapped to cache layers by the
attention module's ``layer_idx`` (execution order otherwise). Each layer's bounds
``max |entry|`` of its queries, keys and values (``amax.site_amax_bounds``, per head, float64)
hold for every input; ``LayerScales.scales`` turns them into FP8 (or NVFP4) k/v scales. They
are re-evaluated from the live parameters whenever one changed in place or moved to a new
storage; a parameter replaced by another tensor is found by name and the graphs are analysed
again on it (never a second forward pass). Parameters with inf/nan are refused by name
before any bound is computed.

Used by the FP8 KV cache of ``generate`` (``geoscale_fx.kv_cache_manager``), by
``export_kv_scales`` and by ``attention_scales``::

    scales = WeightKVScales(model).capture(input_ids)    # one trace
    for layer in scales.layers():                        # per cache layer, in layer order
        k_scale, v_scale = layer.scales("e4m3")          # float32 (n_kv,)
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from geoscale_fx import amax
from geoscale_fx.capture import CapturedGraph, capture_graphs
from geoscale_fx.layer_scales import LayerScales
from geoscale_fx.passes.analyze import analyze_graph
from geoscale_fx.passes.dtensor import to_local
from geoscale_fx.passes.graph_ops import upstream
from geoscale_fx.scaling import NonFiniteWeights

__all__ = ["WeightKVScales"]

log = logging.getLogger("geoscale_fx")


def _layer_index(model: nn.Module, site_name: str) -> Optional[int]:
    try:
        module = model.get_submodule(site_name)
    except AttributeError:
        return None
    index = getattr(module, "layer_idx", None)
    return int(index) if isinstance(index, int) else None


def _parameter_signature(model: nn.Module) -> tuple[tuple, tuple]:
    """``(identities, contents)``: which tensors the model holds (parameters and buffers),
    and whether a parameter changed (in-place version counter, storage: ``module.to`` swaps
    ``p.data``). Buffers' contents are left out: geoscale's own state, updated by every
    compiled call, would otherwise force a recomputation each time. A write through
    ``p.data`` in place leaves both as they were and is not seen."""
    parameters = list(model.parameters())
    return (tuple(id(t) for t in [*parameters, *model.buffers()]),
            tuple((t._version, _storage(t)) for t in parameters))


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        return t.data_ptr()
    except RuntimeError:       # wrapper subclasses (DTensor) have no storage of their own
        return None


def _tensor_names(model: nn.Module) -> dict[int, str]:
    """``id(tensor) -> name`` of every parameter and buffer (a tied one: its first name)."""
    out: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        out.setdefault(id(t), name)
    return out


def _site_reads(graph: CapturedGraph, site) -> list[int]:
    """Positions among ``graph``'s inputs of the parameters the site's q/k/v bounds read."""
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    reads = upstream([by_name[name] for name in site.operand_nodes])
    return sorted(position[n] for n in reads if n in position)


class WeightKVScales:
    """Certified per-layer q/k/v bounds of ``model`` from its current weights.

    ``capture(*args, **kwargs)`` traces the model once (arguments as in a call; a Hugging Face
    model is traced with ``use_cache=False``); ``layers()`` evaluates the bounds, again only
    when the parameters changed (an in-place update, a new storage, or a parameter replaced
    by another tensor of the same name: the traced graph is then re-analysed on the new
    tensors, without a forward pass). Every attention must be supported with traced values,
    and every parameter its bounds read finite: otherwise a ``ValueError`` names the site and
    the reason, or the parameter (never a silent default scale).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._graphs: Optional[list[CapturedGraph]] = None
        self._names: list[dict[int, str]] = []      # per graph: input position -> tensor name
        self._sites: Optional[list] = None
        self._reads: list[tuple[int, list[int]]] = []  # per site: (graph, input positions)
        self._signature: Optional[tuple] = None
        self._layers: Optional[list[LayerScales]] = None

    @property
    def captured(self) -> bool:
        return self._sites is not None

    def capture(self, *args, **kwargs) -> "WeightKVScales":
        if hasattr(self.model, "generation_config"):
            kwargs = {**kwargs, "use_cache": False}
        compiled, self.model._compiled_call_impl = self.model._compiled_call_impl, None
        try:     # apply_ routes __call__ through geoscale: trace the plain model
            graphs = capture_graphs(self.model, *args, **kwargs)
        finally:
            self.model._compiled_call_impl = compiled
        names = _tensor_names(self.model)
        self._graphs = graphs
        self._names = [{i: names[id(v)] for i, v in enumerate(g.example_inputs)
                        if id(v) in names} for g in graphs]
        self._analyze()
        self._signature = None
        log.info("geoscale: kv_cache: %d attention layers traced for k/v scales",
                 len(self._sites))
        return self

    def _analyze(self) -> None:
        sites, reads = [], []
        for index, graph in enumerate(self._graphs):
            found = analyze_graph(graph.gm, graph.example_inputs, graph_index=index,
                                  first_index=len(sites))
            sites += found
            reads += [(index, _site_reads(graph, s) if s.supported else []) for s in found]
        if not sites:
            raise ValueError(f"kv_cache: no attention found in {type(self.model).__name__}")
        for site in sites:
            if not site.supported:
                raise ValueError(f"kv_cache: attention {site.name!r} cannot be bounded from "
                                 f"the weights ({site.reason}), so its k/v scales cannot be "
                                 "predicted; use kv_cache=None for this model")
            if site.value is None:
                raise ValueError(f"kv_cache: attention {site.name!r}: the values could not "
                                 f"be traced to their projection ({site.value_reason}), so "
                                 "v_scale cannot be predicted; use kv_cache=None")
        self._sites, self._reads, self._layers = sites, reads, None

    def layers(self) -> list[LayerScales]:
        """Per cache layer, in layer order; recomputed only if a parameter changed."""
        if self._sites is None:
            raise RuntimeError("WeightKVScales.capture(...) must run before layers()")
        signature = _parameter_signature(self.model)
        if self._layers is None or signature != self._signature:
            if self._signature is not None and signature[0] != self._signature[0]:
                self._rebind()
            self._check_finite()
            self._layers = self._evaluate()
            self._signature = signature
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
                    raise ValueError(f"kv_cache: {name!r}, read by the traced model, is no "
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
        ``LinAlgError``). A finite sum has no inf/nan terms, so one sum per tensor screens
        them all (a few ms less per refresh than ``isfinite``); only a non-finite sum (or
        one that overflowed) is looked at entry by entry."""
        reads = [(site, index, i, to_local(self._graphs[index].example_inputs[i]))
                 for site, (index, positions) in zip(self._sites, self._reads)
                 for i in positions]
        reads = [r for r in reads if isinstance(r[3], torch.Tensor)
                 and r[3].is_floating_point() and r[3].device.type != "meta"]
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for *_, value in reads:
            by_device.setdefault(value.device, []).append(value.sum())
        if all(bool(torch.stack(sums).isfinite().all()) for sums in by_device.values()):
            return
        for site, index, i, value in reads:
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                name = self._names[index].get(i, f"graph input {i}")
                raise NonFiniteWeights(
                    f"geoscale: attention site {site.name!r}: parameter {name!r} is not "
                    f"finite ({bad} inf/nan value(s) out of {value.numel()}); its q/k/v "
                    "bounds (and FP8 scales) would be NaN")

    def _evaluate(self) -> list[LayerScales]:
        out = []
        for position, site in enumerate(self._sites):
            bounds = amax.site_amax_bounds(site)
            if not all(bool(torch.isfinite(b).all()) for b in bounds.values()):
                raise ValueError(f"kv_cache: attention {site.name!r}: its q/k/v bounds are "
                                 "not finite (finite parameters, too large for float64); no "
                                 "FP8 scale can be derived")
            layer = _layer_index(self.model, site.name)
            out.append(LayerScales(position if layer is None else layer, site.name,
                                   bounds["q"], bounds["k"], bounds["v"]))
        layers = sorted(out, key=lambda s: s.layer)
        if [s.layer for s in layers] != list(range(len(layers))):
            raise ValueError("kv_cache: attention layers "
                             f"{[(s.site, s.layer) for s in layers]} do not map one to one "
                             "onto cache layers 0..n-1 (layers sharing a cache, or "
                             "attention the cache does not hold)")
        return layers
