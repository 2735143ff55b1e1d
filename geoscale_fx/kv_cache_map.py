"""Which KV-cache layer holds what, and the attention whose scales bound it.

A cache layer's scales must bound what the layer stores, and only the forward knows what
that is. The model is traced with its cache in use and its writes marked
(``traced_with_writes``: ``kv_cache_layers.marked_cache_writes`` marks ``Cache.update``);
each write (``passes.cache_writes``: its layer index, the sides of the stored keys and
values, the attention reading them) is one ``CacheLayer`` here:

* ``layer`` is the index the model wrote (``update``'s ``layer_idx``): a hybrid's
  linear-attention and SSM layers are written by no attention and get no scale; a shared
  attention called by several layers (Zamba) fills one cache layer per call;
* the keys' and values' bounds are the stored tensors' (``amax.cache_write_bounds``): an
  MLA layer stores its latent, one head (``latent``), bounded as such, not the keys and
  values the attention computes from it after the read;
* the queries' bound is the reading attention's (every site of that name: a differential
  attention's two softmaxes);
* ``readers``: attentions reading the layer's stored tensors without writing any (KV
  sharing: Gemma 3n's last layers reuse earlier layers' keys and values). They hold no cache
  layer of their own, but an engine dequantizes what they read with their own scales, so
  they take the layer's k/v scales (``LayerScales.readers``, with their queries' bound).

A forward whose trace holds no cache write at all (a model without a KV cache, one that
keeps it outside ``Cache.update``, or one that fails with its cache in use at the traced
size) has its attention sites as layers: what an engine's cache would store are their keys
and values, at the module's ``layer_idx`` (execution order otherwise), one to one onto
``0..n-1``.

Refusals (``ValueError``, naming the layer): a write that cannot be bounded or whose reader
is ambiguous, one layer written by two attentions or with differing head counts, an
attention that would read more cache layers than it is called (one call writes one layer:
the attention of the others was not found).

Example::

    layers = cache_layers(model, sites, writes, "kv_cache")
    scales = [layer_scales(l, q_of, kv_of, "kv_cache") for l in layers]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Sequence, TypeVar, Union

import torch
from torch import nn

from geoscale_fx.kv_cache_layers import marked_cache_writes
from geoscale_fx.layer_scales import LayerScales
from geoscale_fx.site_model import AttentionSite, CacheWrite

__all__ = ["CacheLayer", "traced_with_writes", "cache_layers", "layer_scales"]

log = logging.getLogger("geoscale_fx")
T = TypeVar("T")


@dataclass(frozen=True)
class CacheLayer:
    """One cache layer: the attention reading it and what was stored in it."""
    layer: int
    site: str                                # the scales' name: the reading attention's path
    sites: tuple[AttentionSite, ...]          # their queries' bound
    writes: tuple[CacheWrite, ...]            # empty: no write traced (the sites' own k and v)
    #: attentions reading the layer without writing one (KV sharing): the same k/v scales
    readers: tuple[AttentionSite, ...] = ()

    @property
    def latent(self) -> bool:
        return any(w.latent for w in self.writes)


def traced_with_writes(trace: Callable[[dict], T], model: nn.Module, kwargs: dict, who: str
                       ) -> T:
    """``trace(kwargs)`` with the cache writes marked (``marked_cache_writes``), a Hugging
    Face model (it has a ``generation_config``) asked to use its cache. One whose forward
    fails so (a cache its config cannot build, a model with no attention layer for it) is
    traced as before, ``use_cache=False``: no write is seen, and each attention is its own
    layer (``cache_layers``)."""
    if not hasattr(model, "generation_config"):
        with marked_cache_writes():
            return trace(kwargs)
    try:
        with marked_cache_writes():
            return trace({**kwargs, "use_cache": True})
    except Exception as exc:  # noqa: BLE001 — any failure: the trace without a cache
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        log.info("geoscale: %s: %s fails with its cache in use (%s: %s); traced without it, "
                 "so what its cache stores is not seen", who, type(model).__name__,
                 type(exc).__name__, first)
        return trace({**kwargs, "use_cache": False})


def cache_layers(model: nn.Module, sites: Sequence[AttentionSite],
                 writes: Sequence[CacheWrite], who: str) -> list[CacheLayer]:
    """The cache layers of one traced forward, in layer order (see the module doc);
    ``who`` prefixes the refusals."""
    if not writes:
        return _site_layers(model, sites, who)
    by_layer: dict[int, list[CacheWrite]] = {}
    for write in writes:
        if write.reason:
            raise ValueError(f"{who}: cache layer {write.layer}, written by "
                             f"`{write.module or write.node}`: {write.reason}")
        by_layer.setdefault(write.layer, []).append(write)
    out = []
    for layer, group in sorted(by_layer.items()):
        names = sorted({w.site for w in group})
        if len(names) > 1:
            raise ValueError(f"{who}: cache layer {layer} is written by the attentions "
                             f"{names}: its scales would have two names")
        out.append(CacheLayer(layer, names[0], tuple(s for s in sites if s.name == names[0]),
                              tuple(group)))
    _check_calls(out, sites, who)
    writers = {layer.site for layer in out}
    out = [replace(layer, readers=tuple(s for s in sites if s.name not in writers and any(
        s.name in w.readers for w in layer.writes))) for layer in out]
    read = {s.name for layer in out for s in layer.sites + layer.readers}
    unread = [s.name for s in sites if s.name not in read]
    if unread:
        log.info("geoscale: %s: attentions %s read no cache layer: no scales of theirs", who,
                 sorted(set(unread)))
    return out


def _check_calls(layers: list[CacheLayer], sites: Sequence[AttentionSite], who: str) -> None:
    """One call of an attention writes one cache layer: an attention reading more layers
    than it is called reads some whose own attention was not found."""
    for name in {layer.site for layer in layers}:
        written = [layer.layer for layer in layers if layer.site == name]
        calls = sum(s.name == name for s in sites)
        if len(written) > calls:
            raise ValueError(f"{who}: the attention {name!r} ({calls} call(s) in the trace) "
                             f"would read cache layers {written}: an attention writing some "
                             "of them was not found")


def _site_layers(model: nn.Module, sites: Sequence[AttentionSite], who: str
                 ) -> list[CacheLayer]:
    """No cache write traced: each attention site is a layer, at its module's
    ``layer_idx`` (its position otherwise), one to one onto ``0..n-1``."""
    log.info("geoscale: %s: the trace holds no cache write; each attention's own keys and "
             "values are taken as what a cache of it stores", who)
    layers = sorted((CacheLayer(_layer_index(model, s.name, i), s.name, (s,), ())
                     for i, s in enumerate(sites)), key=lambda layer: layer.layer)
    if [layer.layer for layer in layers] != list(range(len(layers))):
        raise ValueError(f"{who}: attention layers {[(l.site, l.layer) for l in layers]} do "
                         "not map one to one onto cache layers 0..n-1 (layers sharing a "
                         "cache, or attention the cache does not hold)")
    return layers


def _layer_index(model: nn.Module, site_name: str, position: int) -> int:
    try:
        index = getattr(model.get_submodule(site_name), "layer_idx", None)
    except AttributeError:
        index = None
    return int(index) if isinstance(index, int) else position


def layer_scales(layer: CacheLayer, q_of: Callable[[AttentionSite], torch.Tensor],
                 kv_of: Callable[[Union[CacheWrite, AttentionSite]], dict], who: str
                 ) -> LayerScales:
    """The layer's bounds: the queries' of its sites, the stored keys' and values' of its
    writes (of its site without writes), each the elementwise max over its parts."""
    q = _max([q_of(s) for s in layer.sites], layer, "query", who)
    parts = [kv_of(w) for w in layer.writes] or [kv_of(s) for s in layer.sites]
    k = _max([p["k"] for p in parts], layer, "stored key", who)
    v = _max([p["v"] for p in parts], layer, "stored value", who)
    names = dict.fromkeys(s.name for s in layer.readers)
    readers = tuple((name, _max([q_of(s) for s in layer.readers if s.name == name], layer,
                                "query", who)) for name in names)
    if not all(bool(torch.isfinite(b).all()) for b in (q, k, v, *(b for _, b in readers))):
        raise ValueError(f"{who}: attention {layer.site!r}: its q/k/v bounds are not finite "
                         "(finite parameters, too large for float64); no FP8 scale can be "
                         "derived")
    return LayerScales(layer.layer, layer.site, q, k, v, latent=layer.latent, readers=readers)


def _max(bounds: list[torch.Tensor], layer: CacheLayer, what: str, who: str
         ) -> torch.Tensor:
    if len({tuple(b.shape) for b in bounds}) != 1:
        raise ValueError(f"{who}: cache layer {layer.layer} ({layer.site!r}): its {what} "
                         f"bounds have differing head counts {[tuple(b.shape) for b in bounds]}")
    out = bounds[0]
    for b in bounds[1:]:
        out = torch.maximum(out, b)
    return out
