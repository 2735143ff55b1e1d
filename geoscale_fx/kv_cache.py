"""An FP8 KV cache whose per-kv-head scales come from the weights (``wrap(model, kv_cache="fp8")``).

Serving engines keep keys and values in FP8 with ``k_scale``/``v_scale`` taken from
calibration data, the first batch, or a default of 1.0. Here the scale of each kv head is the
certified bound on ``max |entry|`` of the keys (values) that reach that layer's attention
(``amax.site_amax_bounds``, from the current weights alone) divided by R_max: no cached
entry can saturate, whatever the input, and the scales are right on the first token after
every weight update — never from observed activations or calibration data.

Pieces:

* ``WeightKVScales`` — the attention sites of one trace of the model (``capture_graphs``
  and ``analyze_graph``, without a cache, so the keys are traced to their projection), mapped
  to cache layers by the attention module's ``layer_idx`` (execution order otherwise), and
  re-evaluated from the live parameters whenever one changed in place or moved to a new
  storage; a parameter replaced by another tensor is found by name and the graphs are
  analysed again on it (never a second forward pass). Parameters with inf/nan are refused
  by name before any bound is computed.
* ``FP8Layer`` — a mixin over any Hugging Face cache layer (``DynamicLayer``, ``StaticLayer``,
  their sliding-window forms): ``update`` quantizes the new states with the layer's frozen
  per-head scales, lets the parent store the FP8 bits (as ``uint8``: CPU has no
  ``index_copy_`` for float8), and returns the dequantized states, as an FP8-KV kernel reads
  them. Entries that reach ±R_max are counted (``saturated``; never a host sync).
* ``NVFP4Layer`` (``kv_cache="nvfp4"``) — the same with NVFP4 storage (``geoscale_fx.nvfp4``:
  E2M1 values, an E4M3 scale per 16 entries of the head dim, packed to 4.5 bits per entry);
  its per-kv-head global scale is bound / (6 · 448), so no block scale can overflow E4M3.
  ``saturated`` counts block scales above 448.
* ``fp8_cache(...)`` — a ``DynamicCache``/``StaticCache`` of such layers; ``KVCacheManager``
  builds one per ``generate`` and keeps the counts for ``report()``.

A cache keeps the scales it was created with (entries already stored must be dequantized with
the scale that stored them); a new ``generate`` call takes the current weights' scales. Keys
written after a weight update inside one cache's life are clamped if they exceed the old
scale, and counted: ``kv_saturated`` in ``report()``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from geoscale_fx import amax, nvfp4
from geoscale_fx.bounds import fp8_max, round_up_f32
from geoscale_fx.capture import CapturedGraph, capture_graphs
from geoscale_fx.fp8 import KV_CACHE_FORMATS, fp8_dtype, kv_format
from geoscale_fx.passes.analyze import analyze_graph
from geoscale_fx.passes.dtensor import to_local
from geoscale_fx.passes.graph_ops import upstream
from geoscale_fx.scaling import NonFiniteWeights

__all__ = ["KV_CACHE_FORMATS", "LayerScales", "scale_from_bound", "WeightKVScales", "FP8Layer",
           "NVFP4Layer", "fp8_cache", "KVCacheManager", "cache_nbytes"]

log = logging.getLogger("geoscale_fx")


@dataclass(frozen=True)
class LayerScales:
    """One cache layer: the attention module that reads it, and its certified bounds."""
    layer: int
    site: str                      # attention site (module path)
    q_bound: torch.Tensor          # (n_q,) float64: max |q entry| per query head
    k_bound: torch.Tensor          # (n_kv,)
    v_bound: torch.Tensor          # (n_kv,)

    def scales(self, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` float32 ``(n_kv,)``: bound / R_max (a divisor); for
        NVFP4 the global scales bound / (6 · 448)."""
        if fmt == nvfp4.NVFP4:
            return nvfp4.global_scale(self.k_bound), nvfp4.global_scale(self.v_bound)
        return scale_from_bound(self.k_bound, fmt), scale_from_bound(self.v_bound, fmt)


def scale_from_bound(bound: torch.Tensor, fmt: str) -> torch.Tensor:
    """``bound / R_max`` as the smallest float32 ``≥`` it (floored at the smallest normal):
    rounding to nearest could land one ulp under and let an entry at the bound saturate."""
    return round_up_f32(bound.detach().double() / fp8_max(fmt))


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


def _quantize(states: torch.Tensor, scale: torch.Tensor, fmt: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uint8 bits of Q(states / scale[h]), entries that reached ±R_max)``."""
    limit = fp8_max(fmt)
    scaled = states.float() / scale.view(1, -1, 1, 1)
    hits = (scaled.abs() >= limit).sum()
    bits = scaled.clamp(-limit, limit).to(fp8_dtype(fmt)).view(torch.uint8)
    return bits, hits


def _dequantize(bits: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype
                ) -> torch.Tensor:
    return (bits.view(fp8_dtype(fmt)).float() * scale.view(1, -1, 1, 1)).to(dtype)


class FP8Layer:
    """Mixin: the parent cache layer stores FP8 bits; ``update`` returns dequantized states."""

    fmt: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    saturated: torch.Tensor        # (2,) int64: key and value entries that reached ±R_max
    compute_dtype: Optional[torch.dtype]

    def setup_fp8(self, k_scale: torch.Tensor, v_scale: torch.Tensor, fmt: str,
                  saturated: torch.Tensor) -> None:
        self.fmt, self.k_scale, self.v_scale = fmt, k_scale, v_scale
        self.saturated, self.compute_dtype = saturated, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.k_scale.numel() not in (1, key_states.shape[1]):
            raise ValueError(f"FP8 KV cache: {key_states.shape[1]} key heads, but "
                             f"{self.k_scale.numel()} k scales (a tensor-parallel shard?)")
        self.compute_dtype = key_states.dtype
        self.k_scale = self.k_scale.to(key_states.device)
        self.v_scale = self.v_scale.to(key_states.device)
        keys, k_hits = _quantize(key_states, self.k_scale, self.fmt)
        values, v_hits = _quantize(value_states, self.v_scale, self.fmt)
        self.saturated.add_(torch.stack([k_hits, v_hits]).to(self.saturated.device))
        keys, values = super().update(keys, values, *args, **kwargs)
        return (_dequantize(keys, self.k_scale, self.fmt, key_states.dtype),
                _dequantize(values, self.v_scale, self.fmt, value_states.dtype))


class NVFP4Layer(FP8Layer):
    """Mixin: the parent cache layer stores packed NVFP4 rows (``nvfp4.pack``: uint8
    ``(B, H, T, d/2 + d/16)``); ``update`` returns the dequantized states. ``k_scale`` and
    ``v_scale`` are the global scales s_g; ``saturated`` counts block scales above 448."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.k_scale.numel() not in (1, key_states.shape[1]):
            raise ValueError(f"NVFP4 KV cache: {key_states.shape[1]} key heads, but "
                             f"{self.k_scale.numel()} global k scales")
        if key_states.shape[-1] % nvfp4.BLOCK or value_states.shape[-1] % nvfp4.BLOCK:
            raise ValueError(f"NVFP4 KV cache: head dims {key_states.shape[-1]}/"
                             f"{value_states.shape[-1]} are not multiples of {nvfp4.BLOCK} "
                             "(NVFP4's block); use kv_cache='fp8'")
        self.compute_dtype = key_states.dtype
        self.k_scale = self.k_scale.to(key_states.device)
        self.v_scale = self.v_scale.to(key_states.device)
        k_g, v_g = self.k_scale.view(1, -1, 1, 1), self.v_scale.view(1, -1, 1, 1)
        keys, k_hits = _nvfp4_store(key_states, k_g)
        values, v_hits = _nvfp4_store(value_states, v_g)
        self.saturated.add_(torch.stack([k_hits, v_hits]).to(self.saturated.device))
        keys, values = super(FP8Layer, self).update(keys, values, *args, **kwargs)
        return (_nvfp4_read(keys, k_g, key_states.shape[-1]).to(key_states.dtype),
                _nvfp4_read(values, v_g, value_states.shape[-1]).to(value_states.dtype))


def _nvfp4_store(states: torch.Tensor, s_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed rows, block scales above 448)`` of ``states`` (B, H, T, d)."""
    overflow = (nvfp4.block_scale_ratio(states, s_g) > nvfp4.E4M3_MAX).sum()
    return nvfp4.pack(*nvfp4.quantize(states, s_g)), overflow


def _nvfp4_read(packed: torch.Tensor, s_g: torch.Tensor, d: int) -> torch.Tensor:
    return nvfp4.dequantize(*nvfp4.unpack(packed, d), s_g)


_FP8_CLASSES: dict[tuple[type, type], type] = {}


def _fp8_class(layer_class: type, mixin: type = FP8Layer) -> type:
    key = (layer_class, mixin)
    if key not in _FP8_CLASSES:
        prefix = "NVFP4" if mixin is NVFP4Layer else "FP8"
        _FP8_CLASSES[key] = type(f"{prefix}{layer_class.__name__}", (mixin, layer_class),
                                 {"__module__": __name__})
    return _FP8_CLASSES[key]


def fp8_cache(config: Any, layers: list[LayerScales], fmt: str, saturated: list[torch.Tensor],
              *, static: bool = False, max_cache_len: Optional[int] = None):
    """A Hugging Face ``DynamicCache`` (or ``StaticCache``) for ``config`` whose layers store
    FP8 (or NVFP4 for ``fmt="nvfp4"``), each with its layer's frozen scales and saturation
    counter."""
    from transformers import DynamicCache, StaticCache

    if static:
        if max_cache_len is None:
            raise ValueError("an FP8 StaticCache needs max_cache_len")
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
    else:
        cache = DynamicCache(config=config)
    if len(cache.layers) != len(layers):
        raise ValueError(f"FP8 KV cache: the config has {len(cache.layers)} cache layers, the "
                         f"model {len(layers)} attention layers")
    for i, (layer, scales, counter) in enumerate(zip(cache.layers, layers, saturated)):
        mixin = NVFP4Layer if fmt == nvfp4.NVFP4 else FP8Layer
        fp8_layer = object.__new__(_fp8_class(type(layer), mixin))   # quantized storage
        fp8_layer.__dict__.update(layer.__dict__)
        k_scale, v_scale = scales.scales(fmt)
        fp8_layer.setup_fp8(k_scale, v_scale, fmt, counter)
        cache.layers[i] = fp8_layer
    return cache


def cache_nbytes(cache) -> int:
    """Bytes of the key and value tensors a cache holds now."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class KVCacheManager:
    """A model's FP8 KV cache: scales from its weights, one cache per ``generate``."""

    def __init__(self, model: nn.Module, kv_cache: str):
        self.fmt = kv_format(kv_cache)
        if getattr(model, "generation_config", None) is None or not callable(
                getattr(model, "generate", None)):
            raise ValueError(f"kv_cache={kv_cache!r} needs a Hugging Face model that generates "
                             f"with its Cache classes; {type(model).__name__} keeps its own "
                             "cache (use kv_cache=None)")
        self.model = model
        self.kv_cache = kv_cache
        self.source = WeightKVScales(model)
        self.saturated: list[torch.Tensor] = []
        self.last_layers: Optional[list[LayerScales]] = None

    def new_cache(self, example_ids: torch.Tensor, *, static: bool = False,
                  max_cache_len: Optional[int] = None):
        """A fresh FP8 cache with the scales of the current weights (capturing the model on
        first use with ``example_ids``)."""
        if not self.source.captured:
            with torch.no_grad():
                self.source.capture(example_ids[..., : min(example_ids.shape[-1], 8)])
        layers = self.source.layers()
        if not self.saturated:
            self.saturated = [torch.zeros(2, dtype=torch.int64) for _ in layers]
        self.last_layers = layers
        return fp8_cache(self.model.config, layers, self.fmt, self.saturated, static=static,
                         max_cache_len=max_cache_len)

    def generate_kwargs(self, args: tuple, kwargs: dict) -> dict:
        """``kwargs`` of a ``generate`` call with an FP8 cache in ``past_key_values`` (unless
        the caller passed a cache of their own, which is used as is, with a warning)."""
        if kwargs.get("past_key_values") is not None:
            log.warning("geoscale: kv_cache=%r: generate got its own past_key_values; it is "
                        "used as is (not FP8)", self.kv_cache)
            return kwargs
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if not isinstance(ids, torch.Tensor):
            raise ValueError(f"kv_cache={self.kv_cache!r}: generate needs input_ids to build "
                             "the FP8 cache")
        kwargs = dict(kwargs)
        implementation = kwargs.pop("cache_implementation", None) or getattr(
            getattr(self.model, "generation_config", None), "cache_implementation", None)
        static = implementation == "static"
        max_len = None
        if static:
            config = self.model.generation_config
            new = kwargs.get("max_new_tokens", config.max_new_tokens)
            max_len = ids.shape[-1] + new if new is not None else kwargs.get(
                "max_length", config.max_length)
        elif implementation not in (None, "dynamic"):
            raise ValueError(f"kv_cache={self.kv_cache!r} supports the dynamic and static "
                             f"caches, not cache_implementation={implementation!r}")
        kwargs["past_key_values"] = self.new_cache(ids, static=static, max_cache_len=max_len)
        return kwargs

    def after_generate(self) -> None:
        total = self.saturated_total()
        if total:
            log.warning("geoscale: kv_cache=%r: %d cached entries reached ±R_max (weights "
                        "changed during one cache's life?)", self.kv_cache, total)

    def saturated_total(self) -> int:
        return int(sum(int(c.sum()) for c in self.saturated))

    def rows(self) -> dict[str, dict]:
        """Per site name: ``k_scale``/``v_scale`` (max over kv heads) and ``kv_saturated``."""
        if self.last_layers is None:
            return {}
        out = {}
        for layer, counter in zip(self.last_layers, self.saturated):
            k_scale, v_scale = layer.scales(self.fmt)
            out[layer.site] = {"k_scale": float(k_scale.max()), "v_scale": float(v_scale.max()),
                               "kv_saturated": int(counter.sum())}
        return out
