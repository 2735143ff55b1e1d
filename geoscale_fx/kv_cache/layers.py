"""Hugging Face cache layers that store keys and values in FP8 (or NVFP4) with frozen scales.

* ``FP8Layer`` — a mixin over any Hugging Face cache layer (``DynamicLayer``, ``StaticLayer``,
  their sliding-window forms): ``update`` quantizes the new states with the layer's frozen
  per-kv-head scales s_h, ``Q(x / s_h)`` (``fp8.saturating_cast``), lets the parent store the
  FP8 bits (as ``uint8``: CPU has no ``index_copy_`` for float8), and returns the dequantized
  states ``Q(x / s_h) · s_h``, as an FP8-KV kernel reads them. Entries that reach ±R_max are
  counted (``saturated``; never a host sync), and so are entries that are not finite
  (``nonfinite``: stored as NaN, an attention reading them is NaN).
* ``NVFP4Layer`` — the same with NVFP4 storage (``geoscale_fx.core.nvfp4``: E2M1 values, an E4M3
  scale per 16 entries of the head dim, packed to 4.5 bits per entry); its per-kv-head global
  scale is s_g ≥ B / (6 · 448), so no block scale can overflow E4M3. ``saturated`` counts
  block scales above 448.
* ``fp8_cache(config, layers, fmt, saturated)`` — a ``DynamicCache``/``StaticCache`` of such
  layers, each with the scales of its ``LayerScales``; ``cache_nbytes`` — what a cache holds.

* ``marked_cache_writes()`` — while it is active, ``Cache.update(keys, values, layer)`` first
  calls ``analysis.forms.cache_writes.cache_write(keys, values, layer)``, so a traced forward holds
  each write as a graph node whose arguments are the tensors the cache stores (the analysis
  of what a layer caches reads them); ``cache_layer_classes`` — the layer classes of the
  cache a config builds (which layers can hold keys and values at all).

Only the cache layers some attention writes take scales (``LayerScales.layer`` is the
``layer_idx`` of the write): a hybrid model's linear-attention and SSM layers keep their own
states as they are. A layer keeps the scales it was created with: entries already stored
must be dequantized with the scale that stored them. Example::

    counters = [torch.zeros(2, dtype=torch.int64) for _ in layers]
    cache = fp8_cache(model.config, layers, "e4m3", counters)   # layers: list[LayerScales]
    model.generate(input_ids, cache=cache)     # past_key_values=cache before transformers 5.24
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from geoscale_fx.core import nvfp4
from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.core.fp8 import NVFP4, fp8_dtype, saturating_cast
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.analysis.forms.cache_writes import cache_write

__all__ = ["FP8Layer", "NVFP4Layer", "fp8_cache", "cache_nbytes", "marked_cache_writes",
           "cache_layer_classes"]


def _quantize(states: torch.Tensor, scale: torch.Tensor, fmt: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uint8 bits of Q(states / scale[h]), entries that reached ±R_max)``."""
    limit = fp8_max(fmt)
    scaled = states.float() / scale.view(1, -1, 1, 1)
    hits = (scaled.abs() >= limit).sum()
    bits = saturating_cast(scaled, fmt).view(torch.uint8)
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

    nonfinite: Optional[torch.Tensor]   # (2,) int64: key and value entries not finite

    def setup_fp8(self, k_scale: torch.Tensor, v_scale: torch.Tensor, fmt: str,
                  saturated: torch.Tensor, nonfinite: Optional[torch.Tensor] = None) -> None:
        self.fmt, self.k_scale, self.v_scale = fmt, k_scale, v_scale
        self.saturated, self.compute_dtype = saturated, None
        self.nonfinite = nonfinite

    def _count_nonfinite(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Entries stored that are not finite (NaN/inf keys or values: stored as NaN, and
        an attention reading them is NaN), counted per call without a host sync."""
        if self.nonfinite is not None:
            bad = torch.stack([(~torch.isfinite(key_states)).sum(),
                               (~torch.isfinite(value_states)).sum()])
            self.nonfinite.add_(bad.to(self.nonfinite.device))

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
        self._count_nonfinite(key_states, value_states)
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
        self._count_nonfinite(key_states, value_states)
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
              *, static: bool = False, max_cache_len: Optional[int] = None,
              nonfinite: Optional[list[torch.Tensor]] = None):
    """A Hugging Face ``DynamicCache`` (or ``StaticCache``) for ``config`` whose layers store
    FP8 (or NVFP4 for ``fmt="nvfp4"``), each with its layer's frozen scales and saturation
    counter (and, given ``nonfinite``, its counter of entries that were not finite)."""
    from transformers import DynamicCache, StaticCache

    if static:
        if max_cache_len is None:
            raise ValueError("an FP8 StaticCache needs max_cache_len")
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
    else:
        cache = DynamicCache(config=config)
    for i, (scales, counter) in enumerate(zip(layers, saturated)):
        layer = cache.layers[scales.layer] if scales.layer < len(cache.layers) else None
        if not _holds_keys(layer):
            raise ValueError(f"FP8 KV cache: attention {scales.site!r} writes cache layer "
                             f"{scales.layer}, but the config's cache has "
                             f"{type(layer).__name__ if layer is not None else 'no layer'} "
                             f"there ({len(cache.layers)} layers)")
        mixin = NVFP4Layer if fmt == NVFP4 else FP8Layer
        fp8_layer = object.__new__(_fp8_class(type(layer), mixin))   # quantized storage
        fp8_layer.__dict__.update(layer.__dict__)
        k_scale, v_scale = scales.scales(fmt)
        fp8_layer.setup_fp8(k_scale, v_scale, fmt, counter,
                            nonfinite[i] if nonfinite is not None else None)
        cache.layers[scales.layer] = fp8_layer
    return cache


def _holds_keys(layer) -> bool:
    """A cache layer that stores keys and values (not a linear-attention state, not a
    placeholder of a layer that stores nothing)."""
    from transformers.cache_utils import CacheLayerMixin

    return isinstance(layer, CacheLayerMixin)


def cache_layer_classes(config: Any) -> Optional[list[str]]:
    """Class names of the layers of ``DynamicCache(config=config)`` (``DynamicLayer``,
    ``LinearAttentionLayer`` …), or None when the config builds no such cache."""
    from transformers import DynamicCache

    try:
        return [type(layer).__name__ for layer in DynamicCache(config=config).layers]
    except Exception:  # noqa: BLE001 — a config transformers cannot build a cache from
        return None


@contextlib.contextmanager
def marked_cache_writes():
    """While active, every ``Cache.update(keys, values, layer_idx)`` first calls
    ``cache_write(keys, values, layer_idx)``: a forward traced inside holds its cache
    writes as graph nodes (``analysis.forms.cache_writes``). Whatever cache the model uses — one it
    builds itself included — is marked; nothing else changes. Without transformers,
    nothing is marked."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        yield
        return
    original = Cache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor):
            cache_write(key_states, value_states, int(layer_idx))
        return original(self, key_states, value_states, layer_idx, *args, **kwargs)

    Cache.update = update
    try:
        yield
    finally:
        Cache.update = original


def cache_nbytes(cache) -> int:
    """Bytes of the key and value tensors a cache holds now."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
