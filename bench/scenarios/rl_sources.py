"""Where an RL loop's FP8 KV-cache scales come from: the field's recipes beside geoscale's.

Every source gives one ``LayerScales`` per cache layer (per tensor: one k and one v scale per
layer, as engines load ``k_scale``/``v_scale``), ``scale = statistic / R_max`` with
``R_max = 448`` (E4M3):

* ``geoscale`` — ``geoscale_fx.attention_scales(policy)`` of the weights at this sync (the
  certified bound on every entry, from the weights alone; ``engine_layer_scales``);
* ``frozen at step 0`` — the same, taken once before training (a checkpoint's static scales);
* ``p99.9 × 1.05, each sync`` — NeMo-RL's recipe: the 99.9th percentile of ``|k|`` and ``|v|``
  per layer over the trainer's batch, times a 1.05 margin, recomputed at every sync
  (``percentile_scales``);
* ``max-abs, each sync`` — the same batch's true maximum (``max_abs_scales``);
* ``static min-max at step 0`` — llm-compressor's static calibration (a min-max observer
  over a calibration set before training, never refreshed): ``max_abs_scales`` once;
* ``unit (1.0)`` — vLLM's and SGLang's default, SkyRL's choice (``unit_scales``);
* ``no FP8`` — the unquantized cache.

The observed statistics read what the cache stores: the keys and values of a forward pass
with a ``DynamicCache`` (``observed_kv``; rotated keys for RoPE models), the calibration
pass NeMo-RL makes with forward hooks. Example::

    >>> import torch
    >>> kv = [(torch.tensor([[1.0, -4.0]]), torch.tensor([[2.0]]))]
    >>> [float(s.scales("e4m3")[0]) * 448 for s in max_abs_scales(kv)]
    [4.0]
"""
from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from bench.scenarios.kv_cache import FMT, _layer_scales
from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.kv_cache.manager import cache_argument

__all__ = ["SOURCES", "PERCENTILE", "MARGIN", "engine_layer_scales", "unit_scales",
           "observed_kv", "quantile", "percentile_scales", "max_abs_scales"]

SOURCES = ("geoscale (each sync)", "geoscale frozen at step 0", "p99.9 × 1.05 (each sync)",
           "max-abs (each sync)", "static min-max at step 0", "unit (1.0)", "no FP8")
#: NeMo-RL's per-step recalibration: the 99.9th percentile of |x|, times 1.05
PERCENTILE, MARGIN = 0.999, 1.05


def engine_layer_scales(engine, scales: dict[str, torch.Tensor]) -> list[LayerScales]:
    """The engine's cache layers with the named ``{path.k_scale, path.v_scale}`` scales,
    each attention module found by its path in the engine (its ``layer_idx``): a name the
    engine does not have is an error here, as a dropped scale is in an engine."""
    layers = {}
    for name, value in scales.items():
        path, _, kind = name.rpartition(".")
        if kind not in ("k_scale", "v_scale"):
            continue
        layer = engine.get_submodule(path).layer_idx      # AttributeError: a foreign name
        layers.setdefault(layer, {})[kind] = value.reshape(-1)[:1].float()
    ordered = [layers[i] for i in range(len(layers))]
    return _layer_scales([s["k_scale"] for s in ordered], [s["v_scale"] for s in ordered])


def unit_scales(n_layers: int) -> list[LayerScales]:
    return _layer_scales([torch.ones(1)] * n_layers, [torch.ones(1)] * n_layers)


def observed_kv(engine, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` each layer's cache stores after a forward pass over ``ids``."""
    cache = DynamicCache(config=engine.config)
    with torch.no_grad():
        engine(ids, use_cache=True, **{cache_argument(): cache})
    return [(layer.keys, layer.values) for layer in cache.layers]


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-quantile of ``x``'s entries with linear interpolation between the two
    nearest ranks (``torch.quantile``'s and numpy's default), by ``kthvalue``: no size
    limit (``torch.quantile`` takes at most 2^24 entries; one layer's keys over a 7B
    model's batch are more)."""
    flat = x.reshape(-1).double()
    position = q * (flat.numel() - 1)
    lo, frac = math.floor(position), position - math.floor(position)
    below = flat.kthvalue(lo + 1).values
    if frac == 0:
        return below
    return below + frac * (flat.kthvalue(lo + 2).values - below)


def _scales(kv, statistic) -> list[LayerScales]:
    limit = fp8_max(FMT)
    return _layer_scales([statistic(k.abs()).reshape(1).float() / limit for k, _ in kv],
                         [statistic(v.abs()).reshape(1).float() / limit for _, v in kv])


def percentile_scales(kv, q: float = PERCENTILE, margin: float = MARGIN) -> list[LayerScales]:
    """``quantile(|x|, q) · margin / R_max`` per layer for keys and values (NeMo-RL)."""
    return _scales(kv, lambda a: quantile(a, q) * margin)


def max_abs_scales(kv) -> list[LayerScales]:
    """``max |x| / R_max`` per layer for keys and values (a min-max observer)."""
    return _scales(kv, lambda a: a.amax())
