"""The FP8 KV cache of ``generate`` (``wrap(model, kv_cache="fp8")``): one cache per call,
with per-kv-head scales from the weights.

Serving engines keep keys and values in FP8 with ``k_scale``/``v_scale`` taken from
calibration data, the first batch, or a default of 1.0. Here the scale of each stored head is
the certified bound on ``max |entry|`` of what the model stores in that cache layer — its
attention's keys (values), or an MLA layer's latent — (``geoscale_fx.kv_cache.weight_scales``, from
the current weights alone) divided by R_max
(``geoscale_fx.kv_cache.layer_scales``): no cached entry can saturate, whatever the input, and the
scales are right on the first token after every weight update — never from observed
activations or calibration data. ``kv_cache="nvfp4"`` stores NVFP4 instead, with global
scales bound / (6 · 448) (``geoscale_fx.kv_cache.layers``).

``KVCacheManager`` builds one cache (``kv_cache_layers.fp8_cache``) per ``generate`` and keeps
the saturation counts for ``report()``. A cache keeps the scales it was created with (entries
already stored must be dequantized with the scale that stored them); a new ``generate`` call
takes the current weights' scales. Keys written after a weight update inside one cache's life
are clamped if they exceed the old scale, and counted: ``kv_saturated`` in ``report()``.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from geoscale_fx.core.fp8 import kv_format
from geoscale_fx.kv_cache.layers import fp8_cache
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.kv_cache.weight_scales import WeightKVScales

__all__ = ["KVCacheManager", "cache_argument", "passed_cache", "CACHE_ARGUMENTS"]

log = logging.getLogger("geoscale_fx")

#: the names ``generate`` has taken a cache under: ``cache`` from transformers 5.24
#: (``past_key_values`` deprecated there, to be removed in 6.0), ``past_key_values`` before
CACHE_ARGUMENTS = ("cache", "past_key_values")


def passed_cache(kwargs: dict) -> tuple[Optional[str], Any]:
    """``(name, cache)`` of the cache a call's ``kwargs`` pass under one of
    ``CACHE_ARGUMENTS``, or ``(None, None)``."""
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return name, kwargs[name]
    return None, None


def cache_argument() -> str:
    """The name the installed transformers' ``generate`` takes a cache under (its
    ``ALL_CACHE_NAMES[0]``-style list of cache names)."""
    from transformers.generation import utils

    names = getattr(utils, "ALL_CACHE_NAMES", ())
    return "cache" if "cache" in names else "past_key_values"


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
        self.nonfinite: list[torch.Tensor] = []     # per layer: keys, values not finite
        self._nonfinite_said = 0
        self.last_layers: Optional[list[LayerScales]] = None

    def new_cache(self, example_ids: torch.Tensor, *, static: bool = False,
                  max_cache_len: Optional[int] = None):
        """A fresh FP8 cache with the scales of the current weights (capturing the model on
        first use with ``example_ids``)."""
        if not self.source.captured:
            try:
                with torch.no_grad():
                    self.source.capture(example_ids[..., : min(example_ids.shape[-1], 8)])
            except ValueError as exc:      # a refusal: say how to run the model meanwhile
                raise ValueError(f"{exc} Meanwhile kv_cache=None runs this model with its "
                                 "cache unquantized.") from exc
        layers = self.source.layers()
        if not self.saturated:
            self.saturated = [torch.zeros(2, dtype=torch.int64) for _ in layers]
            self.nonfinite = [torch.zeros(2, dtype=torch.int64) for _ in layers]
        self.last_layers = layers
        return fp8_cache(self.model.config, layers, self.fmt, self.saturated, static=static,
                         max_cache_len=max_cache_len, nonfinite=self.nonfinite)

    def generate_kwargs(self, args: tuple, kwargs: dict) -> dict:
        """``kwargs`` of a ``generate`` call with an FP8 cache under generate's cache argument
        (``cache_argument``), unless the caller passed a cache of their own under either name,
        which is used as is, with a warning."""
        own, _ = passed_cache(kwargs)
        if own is not None:
            log.warning("geoscale: kv_cache=%r: generate got its own %s; it is used as is "
                        "(not FP8)", self.kv_cache, own)
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
        kwargs[cache_argument()] = self.new_cache(ids, static=static, max_cache_len=max_len)
        return kwargs

    def after_generate(self) -> None:
        total = self.saturated_total()
        if total:
            log.warning("geoscale: kv_cache=%r: %d cached entries reached ±R_max (weights "
                        "changed during one cache's life?)", self.kv_cache, total)
        bad = int(sum(int(c.sum()) for c in self.nonfinite))
        if bad > self._nonfinite_said:      # said once per new count
            log.warning("geoscale: kv_cache=%r: %d cached key/value entries were not finite "
                        "(NaN/inf keys or values: stored as NaN, and the attention reading "
                        "them gives NaN); report() counts them per layer (kv_nonfinite)",
                        self.kv_cache, bad)
            self._nonfinite_said = bad

    def saturated_total(self) -> int:
        return int(sum(int(c.sum()) for c in self.saturated))

    def rows(self) -> dict[str, dict]:
        """Per site name: ``k_scale``/``v_scale`` (max over kv heads, and over the cache
        layers the site writes: a shared block called by several layers), ``kv_saturated``
        and, where some were, ``kv_nonfinite`` (entries that were not finite), summed over
        those layers."""
        if self.last_layers is None:
            return {}
        out: dict[str, dict] = {}
        for layer, counter, bad in zip(self.last_layers, self.saturated, self.nonfinite):
            k_scale, v_scale = layer.scales(self.fmt)
            row = out.setdefault(layer.site, {"k_scale": 0.0, "v_scale": 0.0,
                                              "kv_saturated": 0})
            row["k_scale"] = max(row["k_scale"], float(k_scale.max()))
            row["v_scale"] = max(row["v_scale"], float(v_scale.max()))
            row["kv_saturated"] += int(counter.sum())
            if int(bad.sum()):
                row["kv_nonfinite"] = row.get("kv_nonfinite", 0) + int(bad.sum())
        return out
