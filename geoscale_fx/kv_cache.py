"""An FP8 KV cache whose per-kv-head scales come from the weights (``wrap(model, kv_cache="fp8")``).

Serving engines keep keys and values in FP8 with ``k_scale``/``v_scale`` taken from
calibration data, the first batch, or a default of 1.0. Here the scale of each kv head is the
certified bound on ``max |entry|`` of the keys (values) that reach that layer's attention
(``AttentionSite.amax_bounds``, from the current weights alone) divided by R_max: no cached
entry can saturate, whatever the input, and the scales are right on the first token after
every weight update — never from observed activations or calibration data.

Pieces:

* ``WeightKVScales`` — the attention sites of one trace of the model (``find_attention``,
  without a cache, so the keys are traced to their projection), mapped to cache layers by the
  attention module's ``layer_idx`` (execution order otherwise), and re-evaluated from the live
  parameters whenever a parameter's identity or in-place version changed.
* ``FP8Layer`` — a mixin over any Hugging Face cache layer (``DynamicLayer``, ``StaticLayer``,
  their sliding-window forms): ``update`` quantizes the new states with the layer's frozen
  per-head scales, lets the parent store the FP8 bits (as ``uint8``: CPU has no
  ``index_copy_`` for float8), and returns the dequantized states, as an FP8-KV kernel reads
  them. Entries that reach ±R_max are counted (``saturated``; never a host sync).
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

from geoscale_fx.bounds import fp8_max
from geoscale_fx.fp8 import fp8_dtype

__all__ = ["KV_CACHE_FORMATS", "LayerScales", "scale_from_bound", "WeightKVScales", "FP8Layer", "fp8_cache",
           "KVCacheManager", "cache_nbytes"]

log = logging.getLogger("geoscale_fx")

#: ``kv_cache=`` value -> FP8 format
KV_CACHE_FORMATS = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}


def kv_format(kv_cache: str) -> str:
    try:
        return KV_CACHE_FORMATS[kv_cache]
    except KeyError:
        raise ValueError(f"kv_cache={kv_cache!r}; allowed values: "
                         f"{sorted(KV_CACHE_FORMATS)} (or None for the model's own cache)"
                         ) from None


@dataclass(frozen=True)
class LayerScales:
    """One cache layer: the attention module that reads it, and its certified bounds."""
    layer: int
    site: str                      # attention site (module path)
    q_bound: torch.Tensor          # (n_q,) float64: max |q entry| per query head
    k_bound: torch.Tensor          # (n_kv,)
    v_bound: torch.Tensor          # (n_kv,)

    def scales(self, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` float32 ``(n_kv,)``: bound / R_max (a divisor)."""
        return scale_from_bound(self.k_bound, fmt), scale_from_bound(self.v_bound, fmt)


def scale_from_bound(bound: torch.Tensor, fmt: str) -> torch.Tensor:
    """``bound / R_max`` as the smallest float32 ``≥`` it (floored at the smallest normal):
    rounding to nearest could land one ulp under and let an entry at the bound saturate."""
    exact = bound.detach().double() / fp8_max(fmt)
    y = exact.to(torch.float32)
    y = torch.where(y.double() < exact, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.clamp_min(torch.finfo(torch.float32).tiny)


def _layer_index(model: nn.Module, site_name: str) -> Optional[int]:
    try:
        module = model.get_submodule(site_name)
    except AttributeError:
        return None
    index = getattr(module, "layer_idx", None)
    return int(index) if isinstance(index, int) else None


def _parameter_signature(model: nn.Module) -> tuple:
    return tuple((id(p), p._version) for p in model.parameters())


class WeightKVScales:
    """Certified per-layer q/k/v bounds of ``model`` from its current weights.

    ``capture(*args, **kwargs)`` traces the model once (arguments as in a call; a Hugging Face
    model is traced with ``use_cache=False``); ``layers()`` evaluates the bounds, again only
    when the parameters changed. Every attention must be supported with traced values:
    otherwise a ``ValueError`` names the site and the reason (never a silent default scale).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._sites: Optional[list] = None
        self._signature: Optional[tuple] = None
        self._layers: Optional[list[LayerScales]] = None

    @property
    def captured(self) -> bool:
        return self._sites is not None

    def capture(self, *args, **kwargs) -> "WeightKVScales":
        from geoscale_fx.capture import find_attention

        if hasattr(self.model, "generation_config"):
            kwargs = {**kwargs, "use_cache": False}
        compiled, self.model._compiled_call_impl = self.model._compiled_call_impl, None
        try:     # apply_ routes __call__ through geoscale: trace the plain model
            sites = find_attention(self.model, *args, **kwargs)
        finally:
            self.model._compiled_call_impl = compiled
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
        self._sites, self._layers = sites, None
        log.info("geoscale: kv_cache: %d attention layers traced for k/v scales", len(sites))
        return self

    def layers(self) -> list[LayerScales]:
        """Per cache layer, in layer order; recomputed only if a parameter changed."""
        if self._sites is None:
            raise RuntimeError("WeightKVScales.capture(...) must run before layers()")
        signature = _parameter_signature(self.model)
        if self._layers is None or signature != self._signature:
            self._layers = self._evaluate()
            self._signature = signature
        return self._layers

    def _evaluate(self) -> list[LayerScales]:
        out = []
        for position, site in enumerate(self._sites):
            bounds = site.amax_bounds()
            if not all(bool(torch.isfinite(b).all()) for b in bounds.values()):
                raise ValueError(f"kv_cache: attention {site.name!r}: its q/k/v bounds are "
                                 "not finite (non-finite parameters in its projections or "
                                 "norms); no FP8 scale can be derived")
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


_FP8_CLASSES: dict[type, type] = {}


def _fp8_class(layer_class: type) -> type:
    if layer_class not in _FP8_CLASSES:
        _FP8_CLASSES[layer_class] = type(f"FP8{layer_class.__name__}", (FP8Layer, layer_class),
                                         {"__module__": __name__})
    return _FP8_CLASSES[layer_class]


def fp8_cache(config: Any, layers: list[LayerScales], fmt: str, saturated: list[torch.Tensor],
              *, static: bool = False, max_cache_len: Optional[int] = None):
    """A Hugging Face ``DynamicCache`` (or ``StaticCache``) for ``config`` whose layers store
    FP8, each with its layer's frozen scales and saturation counter."""
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
        fp8_layer = object.__new__(_fp8_class(type(layer)))   # the same layer, FP8 storage
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
