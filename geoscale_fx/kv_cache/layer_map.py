"""Which KV-cache layer holds what, and the attention whose scales bound it.

A cache layer's scales must bound what the layer stores, and only the forward knows what
that is. The model is traced with its cache in use and its writes marked
(``traced_with_writes``: ``kv_cache_layers.marked_cache_writes`` marks ``Cache.update``);
each write (``analysis.forms.cache_writes``: its layer index, the sides of the stored keys and
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

Refusals are decided per cache layer, from the trace alone (``plan_cache_layers``: a
``CachePlan`` of the bounded layers and the refused ones, ``kv_refusals.LayerRefusal``): a
reading attention that cannot be bounded from the weights, a write that cannot be bounded or
whose reader is ambiguous, one layer written by two attentions, an attention that would read
more cache layers than it is called (one call writes one layer: the attention of the others
was not found), and without a traced write, values not traced to their projection. A refused
layer keeps its index, so the others keep theirs. ``CachePlan.settle`` decides what a refusal
does: a ``ValueError`` (strict: the FP8 KV cache of ``generate``, ``cache_layers``), or the
layer left out with a warning (``export_kv_scales``, partial by default) unless no layer is
left. Only an attention-to-layer mapping that is not one to one (no write traced), and
differing head counts or non-finite bounds found when the bounds are evaluated
(``layer_scales``), are always a ``ValueError``.

Example::

    plan = plan_cache_layers(model, sites, writes, "kv_cache")
    plan.settle("kv_cache", partial=False)         # any refusal raises
    scales = [layer_scales(l, q_of, kv_of, "kv_cache") for l in plan.layers]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Sequence, TypeVar, Union

import torch
from torch import nn

from geoscale_fx.kv_cache.layers import marked_cache_writes
from geoscale_fx.kv_cache.refusals import LayerRefusal, with_remedy
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.sites.model import AttentionSite, CacheWrite

__all__ = ["CacheLayer", "CachePlan", "traced_with_writes", "cache_layers",
           "plan_cache_layers", "layer_scales"]

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


@dataclass(frozen=True)
class CachePlan:
    """The cache layers of one traced forward: those whose scales can be bounded from the
    weights, and the refused ones (``kv_refusals.LayerRefusal``), decided from the trace
    alone, before any weight is read. A refused layer keeps its index: the others keep
    theirs."""
    layers: tuple[CacheLayer, ...]
    #: cache layers, then KV-sharing readers, then (``layer=None``) refused attentions that
    #: read no cache layer, on which no scale depends
    refused: tuple[LayerRefusal, ...] = ()

    @property
    def left_out(self) -> tuple[LayerRefusal, ...]:
        """The refusals that leave a scale out: a cache layer's, or a KV-sharing reader's."""
        return tuple(r for r in self.refused if r.layer is not None)

    def settle(self, who: str, partial: bool) -> None:
        """Strict (``partial=False``): any refusal is a ``ValueError`` (the first, with the
        count of the others). Partial: a warning names every layer left out and why; a
        ``ValueError`` only when no layer is left."""
        if not self.refused:
            return
        first, others = self.refused[0].message(who), len(self.refused) - 1
        if not partial:
            raise ValueError(first + (f" ({others} more refused.)" if others else ""))
        if not self.layers:
            raise ValueError(f"{first} No cache layer can be bounded ({len(self.refused)} "
                             "refused): there is nothing to export.")
        for refusal in self.refused:
            if refusal.layer is None:
                log.info("geoscale: %s", refusal.message(who))
        if self.left_out:
            layers = sum(isinstance(r.layer, int) for r in self.left_out)
            readers = len(self.left_out) - layers
            log.warning("geoscale: %s: %d of %d cache layers%s left without scales (a serving "
                        "engine uses its default scale for them, 1.0 in vLLM: entries beyond "
                        "±448 saturate):\n%s", who, layers, len(self.layers) + layers,
                        f" and {readers} attention(s) reusing another's" if readers else "",
                        "\n".join(f"  {r.message(who)}" for r in self.left_out))


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
    """The cache layers of one traced forward, in layer order (see the module doc); any
    refusal is a ``ValueError`` prefixed ``who`` (``CachePlan.settle``, strict)."""
    plan = plan_cache_layers(model, sites, writes, who)
    plan.settle(who, partial=False)
    return list(plan.layers)


def plan_cache_layers(model: nn.Module, sites: Sequence[AttentionSite],
                      writes: Sequence[CacheWrite], who: str) -> CachePlan:
    """The cache layers of one traced forward, in layer order, and the refused ones, each
    refused whole and keeping its index (see the module doc). Only a mapping of attentions
    onto cache layers that is not one to one (no write traced) is a ``ValueError`` here: no
    layer has an index then."""
    if writes:
        layers, refused = _written_layers(sites, writes)
    else:
        layers, refused = _site_layers(model, sites, who), []
    layers, more = _bounded(layers)
    refused += more
    read = {s.name for layer in layers for s in layer.sites + layer.readers}
    unread = [name for name in dict.fromkeys(s.name for s in sites)
              if name not in read | {r.site for r in refused}]
    if unread:
        log.info("geoscale: %s: attentions %s read no cache layer: no scales of theirs", who,
                 sorted(unread))
    refused += [LayerRefusal(None, s.name, _unbounded(s)) for s in sites
                if s.name in unread and not s.supported]
    return CachePlan(tuple(layers), tuple(sorted(refused, key=_refusal_order)))


def _written_layers(sites: Sequence[AttentionSite], writes: Sequence[CacheWrite]
                    ) -> tuple[list[CacheLayer], list[LayerRefusal]]:
    """The layers the traced writes fill, and those refused for their writes alone: a write
    that cannot be bounded or named, two attentions writing one layer, an attention reading
    more layers than it is called."""
    by_layer: dict[int, list[CacheWrite]] = {}
    for write in writes:
        by_layer.setdefault(write.layer, []).append(write)
    overcalled = _overcalled(by_layer, sites)
    out, refused = [], []
    for layer, group in sorted(by_layer.items()):
        bad = [w for w in group if w.reason]
        names = sorted({w.site for w in group if w.site})
        owner = next((s for s in sites if s.name in names and not s.supported), None)
        if len(names) > 1:
            refused.append(LayerRefusal(layer, names[0], (
                f"it is written by the attentions {names}: its scales would have two names")))
        elif layer in overcalled:
            refused.append(LayerRefusal(layer, names[0], overcalled[layer]))
        elif owner is not None:       # the reading attention's refusal first: it is the cause
            refused.append(LayerRefusal(layer, owner.name, _unbounded(owner)))
        elif bad:
            refused.append(LayerRefusal(layer, bad[0].site or bad[0].module or bad[0].node,
                                        "; ".join(dict.fromkeys(w.reason for w in bad))))
        else:
            own = tuple(s for s in sites if s.name == names[0])
            out.append(CacheLayer(layer, names[0], own, tuple(group)))
    writers = {layer.site for layer in out} | {r.site for r in refused}
    out = [replace(layer, readers=tuple(s for s in sites if s.name not in writers and any(
        s.name in w.readers for w in layer.writes))) for layer in out]
    return out, refused + _stranded_readers(by_layer, refused, writers)


def _stranded_readers(by_layer: dict[int, list[CacheWrite]], refused: list[LayerRefusal],
                      writers: set[str]) -> list[LayerRefusal]:
    """KV-sharing readers of refused layers: what they read is stored without a scale, so
    they have none either."""
    out: dict[str, LayerRefusal] = {}
    for refusal in refused:
        for write in by_layer[refusal.layer]:
            for name in (n for n in write.readers if n not in writers):
                out.setdefault(name, LayerRefusal(name, name, (
                    f"it reads the keys and values of cache layer {refusal.layer}, which is "
                    "refused")))
    return list(out.values())


def _overcalled(by_layer: dict[int, list[CacheWrite]], sites: Sequence[AttentionSite]
                ) -> dict[int, str]:
    """Layer -> why, for the layers of an attention that would read more cache layers than
    it is called: one call writes one layer, so the attention of some of them was not
    found, and which ones is unknown."""
    written: dict[str, list[int]] = {}
    for layer, group in sorted(by_layer.items()):
        for name in dict.fromkeys(w.site for w in group if w.site):
            written.setdefault(name, []).append(layer)
    out = {}
    for name, layers in written.items():
        calls = sum(s.name == name for s in sites)
        if len(layers) > calls:
            out.update(dict.fromkeys(layers, (
                f"the attention {name!r} ({calls} call(s) in the trace) would read cache "
                f"layers {layers}: an attention writing some of them was not found")))
    return out


def _bounded(layers: list[CacheLayer]) -> tuple[list[CacheLayer], list[LayerRefusal]]:
    """The layers whose attention is bounded from the weights (and, without a traced write,
    whose values are traced to their projection). A KV-sharing reader that is not bounded
    is refused on its own; the layer it reads keeps its scales."""
    out, refused = [], []
    for layer in layers:
        site = next((s for s in layer.sites if not s.supported), None)
        if site is None and not layer.writes:
            site = next((s for s in layer.sites if s.value is None), None)
        if site is not None:
            refused.append(LayerRefusal(layer.layer, layer.site, _unbounded(site)))
            continue
        bad = {s.name: s for s in reversed(layer.readers) if not s.supported}
        refused += [LayerRefusal(name, name, _unbounded(s)) for name, s in bad.items()]
        out.append(replace(layer, readers=tuple(s for s in layer.readers
                                                if s.name not in bad)))
    return out, refused


def _unbounded(site: AttentionSite) -> str:
    """Why ``site``'s scales cannot be bounded: its queries and keys, else its values."""
    if not site.supported:
        return f"the attention cannot be bounded from the weights ({site.reason})"
    return (f"the values could not be traced to their projection ({site.value_reason}), so "
            "v_scale cannot be predicted")


def _refusal_order(refusal: LayerRefusal) -> tuple:
    """Cache layers by index, then KV-sharing readers, then attentions reading none."""
    if isinstance(refusal.layer, int):
        return (0, refusal.layer, "")
    return (1 if refusal.layer else 2, 0, refusal.site)


def _site_layers(model: nn.Module, sites: Sequence[AttentionSite], who: str
                 ) -> list[CacheLayer]:
    """No cache write traced: each attention site is a layer, at its module's
    ``layer_idx`` (its position otherwise), one to one onto ``0..n-1``."""
    log.info("geoscale: %s: the trace holds no cache write; each attention's own keys and "
             "values are taken as what a cache of it stores", who)
    layers = sorted((CacheLayer(_layer_index(model, s.name, i), s.name, (s,), ())
                     for i, s in enumerate(sites)), key=lambda layer: layer.layer)
    if [layer.layer for layer in layers] != list(range(len(layers))):
        raise ValueError(with_remedy(
            f"{who}: attention layers {[(l.site, l.layer) for l in layers]} do not map one "
            "to one onto cache layers 0..n-1 (layers sharing a cache, or attention the cache "
            "does not hold)"))
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
