"""Several FP8 KV caches in one batch: each group of rows with its own per-layer k/v scales.

Scoring the same tokens under G sources of scales takes G forward passes through G caches;
with the tokens repeated G times along the batch, it takes one (measured: about a fifth of
the time at the zoo's shape). ``batched_fp8_cache(config, groups, rows)`` is a Hugging Face
``DynamicCache`` whose layer ``l`` quantizes batch rows ``[g·rows, (g+1)·rows)`` with group
``g``'s layer-``l`` scales, as ``geoscale_fx.kv_cache.layers.FP8Layer`` does with one scale
per head: ``Q(x / s)`` by ``geoscale_fx.core.fp8.saturating_cast``, stored as E4M3 bits,
returned dequantized ``Q(x / s)·s``; entries reaching ±448 are counted per group
(``saturated``, ``(groups, 2)``: keys, values). Per-tensor scales only (one k and one v scale
per layer and group), as the RL scenario's sources give. Example::

    cache = batched_fp8_cache(model.config, [geoscale_layers, unit_layers], rows=8)
    logits = model(tokens.repeat(2, 1), use_cache=True, cache=cache).logits
    cache.saturated, range_used(cache)          # per group
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.core.fp8 import fp8_dtype, saturating_cast
from geoscale_fx.kv_cache.layer_scales import LayerScales

__all__ = ["batched_fp8_cache", "range_used"]

FMT = "e4m3"


class _RowScaledLayer:
    """Mixin over a cache layer: per batch row one k and one v scale (``k_rows``, ``v_rows``
    of shape ``(B,)``), the parent storing the FP8 bits."""

    k_rows: torch.Tensor
    v_rows: torch.Tensor
    saturated: torch.Tensor          # (groups, 2) int64, shared by every layer of the cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k_bits = self._store(key_states, self.k_rows, 0)
        v_bits = self._store(value_states, self.v_rows, 1)
        k_bits, v_bits = super().update(k_bits, v_bits, *args, **kwargs)
        return (_read(k_bits, self.k_rows, key_states.dtype),
                _read(v_bits, self.v_rows, value_states.dtype))

    def _store(self, states: torch.Tensor, rows: torch.Tensor, slot: int) -> torch.Tensor:
        scaled = states.float() / rows.view(-1, 1, 1, 1)                    # (B, H, T, d)
        hits = (scaled.abs() >= fp8_max(FMT)).reshape(len(self.saturated), -1).sum(-1)
        self.saturated[:, slot] += hits
        return saturating_cast(scaled, FMT).view(torch.uint8)


def _read(bits: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (bits.view(fp8_dtype(FMT)).float() * rows.view(-1, 1, 1, 1)).to(dtype)


_CLASSES: dict[type, type] = {}


def batched_fp8_cache(config, groups: list[list[LayerScales]], rows: int) -> DynamicCache:
    """A ``DynamicCache`` for ``len(groups) · rows`` batch rows, group ``g`` stored with the
    per-tensor scales of ``groups[g]`` (one ``LayerScales`` per cache layer, in order)."""
    cache = DynamicCache(config=config)
    if any(len(g) != len(cache.layers) for g in groups):
        raise ValueError(f"batched_fp8_cache: every group needs {len(cache.layers)} layers' "
                         f"scales, got {[len(g) for g in groups]}")
    cache.saturated = torch.zeros(len(groups), 2, dtype=torch.int64)
    for i, layer in enumerate(cache.layers):
        per_group = [g[i].scales(FMT) for g in groups]
        if any(k.numel() != 1 or v.numel() != 1 for k, v in per_group):
            raise ValueError("batched_fp8_cache takes per-tensor scales (one per layer)")
        cls = _CLASSES.setdefault(type(layer), type(f"RowScaled{type(layer).__name__}",
                                                    (_RowScaledLayer, type(layer)), {}))
        scaled = object.__new__(cls)
        scaled.__dict__.update(layer.__dict__)
        scaled.k_rows = torch.cat([k.float() for k, _ in per_group]).repeat_interleave(rows)
        scaled.v_rows = torch.cat([v.float() for _, v in per_group]).repeat_interleave(rows)
        scaled.saturated = cache.saturated
        cache.layers[i] = scaled
    return cache


def range_used(cache: DynamicCache) -> torch.Tensor:
    """``(groups,)``: the largest ``|x / s|`` stored by each group, over layers, keys and
    values, over 448 (1.0: some entry saturated)."""
    groups = len(cache.saturated)
    worst = torch.zeros(groups)
    for layer in cache.layers:
        for bits in (layer.keys, layer.values):
            stored = bits.view(fp8_dtype(FMT)).float().abs().reshape(groups, -1).amax(-1)
            worst = torch.maximum(worst, stored)
    return worst / fp8_max(FMT)
