"""The host side of incremental cached keys: which cache tensors a running maximum covers.

A site whose keys come from a cache that is only moved (``passes.cached_keys``) measures only
this call's new keys in the graph and keeps ``key_norm_max``, the running per-key-head
maximum of everything written before. That maximum covers a cache tensor only if every entry
of the tensor went through the graph: this module records, after each call of a compiled
graph (per running maximum: a dict lookup and a few weak references), the cache
tensors the graph read and wrote (the past placeholders, mutated in place by a StaticCache,
and the graph outputs that are the key or a slice of it: a DynamicCache's ``cat``), each with
its in-place version counter and the version of the running maximum at that moment.

Before a call, a past cache tensor is *trusted* when it is one of those tensors, unchanged
since (same version), and the running maximum is the very value recorded with it (same
version: no other cache, checkpoint load or cold start has rewritten it since). Otherwise —
a fresh cache, a cache the user passed or edited, a beam reorder or crop that built a new
tensor, a reset — the host measures the past tensors (``key_head_norms``, O(cache), once) and
*replaces* the running maximum with that measurement before the graph runs. So the bound
holds for whatever the cache holds, and a decode loop pays O(new tokens) per step.

A write through ``.data`` bypasses version counters and is not seen (as for the weights: see
the README's inference section); inference-mode tensors keep no version counter, so their
caches are re-measured every call (correct, O(cache)).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Node

from geoscale_fx.head_weights import key_head_norms
from geoscale_fx.passes.cached_keys import whole_vector_slices
from geoscale_fx.passes.graph_ops import op_of
from geoscale_fx.site_terms import Side

__all__ = ["KeyNormTrust"]


def _version(t: Any) -> int | None:
    try:
        return t._version
    except (AttributeError, RuntimeError):     # inference-mode tensors have no counter
        return None


@dataclass
class _Trusted:
    """After a call, for one running maximum: its version, and the cache tensors it covers
    (weak references, each with the tensor's version then)."""
    running: weakref.ref
    version: int | None
    caches: list[tuple[weakref.ref, int]]

    def covers(self, cache: Any, running: torch.Tensor) -> bool:
        if self.running() is not running or self.version != _version(running) or \
                self.version is None:
            return False
        version = _version(cache)
        return version is not None and any(ref() is cache and seen == version
                                           for ref, seen in self.caches)


def _stored_from(node: Node, key: str) -> bool:
    """``node`` is the key node, or a whole-vector slice/copy of it (a cache keeps it)."""
    while True:
        if node.name == key:
            return True
        op = op_of(node)
        moved = op in ("contiguous", "clone", "detach") or (
            op == "getitem" and whole_vector_slices(node.args[1]))   # heads stay in place
        if moved and isinstance(node.args[0], Node):
            node = node.args[0]
            continue
        return False


#: id of a running maximum -> what it covered after the last call of any graph with it
#: (dropped when the tensor dies; the prefill graph's cache is trusted by the decode graph's
#: first call)
_TRUSTED: dict[int, _Trusted] = {}


@dataclass(frozen=True)
class _Entry:
    site: int                     # index among the runtime's plans
    state: str                    # the running maximum's state name
    axes: tuple[int, int]         # (head axis, channel axis) of the keys
    past: tuple[tuple[int, int], ...]   # (graph-input position, head repeat) of past caches
    outputs: tuple[int, ...]      # graph-output positions that a cache stores


class KeyNormTrust:
    """For one compiled graph: before a call, re-measure untrusted caches; after it, trust
    what the graph wrote. Empty (and free) for graphs without incremental keys."""

    def __init__(self, gm: GraphModule, plans: Sequence[Any]):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        by_name = {n.name: n for n in gm.graph.nodes}
        output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        outputs = list(output) if isinstance(output, (tuple, list)) else [output]
        self.entries: list[_Entry] = []
        for index, plan in enumerate(plans):
            for estimator in getattr(plan.policy, "estimators", ()):
                name = getattr(estimator, "running_state", None)
                if name is None:
                    continue
                side: Side = estimator.term.k
                past = tuple((placeholders.index(by_name[n]), r) for n, r in side.observed_past)
                stored = tuple(i for i, o in enumerate(outputs)
                               if isinstance(o, Node) and _stored_from(o, side.source.node))
                self.entries.append(_Entry(index, name, side.observed_axes, past, stored))

    def before(self, args: Sequence[Any], states: Sequence[Any]) -> int:
        """Re-measure the past caches the running maxima do not cover; returns how many
        sites were re-measured."""
        measured = 0
        for entry in self.entries:
            running = getattr(states[entry.site], entry.state)
            trusted = _TRUSTED.get(id(running))
            caches = [(args[i], r) for i, r in entry.past]
            if trusted is not None and all(trusted.covers(c, running) for c, _ in caches):
                continue
            with torch.no_grad():
                norms = torch.zeros_like(running)
                for cache, repeat in caches:
                    heads = key_head_norms(cache, entry.axes).repeat_interleave(repeat)
                    norms = torch.maximum(norms, heads.to(norms))
                running.copy_(norms)
            measured += 1
        return measured

    def after(self, args: Sequence[Any], out: Any, states: Sequence[Any]) -> None:
        """Trust the caches this call read and wrote, with the running maxima as they are."""
        if not self.entries:
            return
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        for entry in self.entries:
            running = getattr(states[entry.site], entry.state)
            tensors = [args[i] for i, _ in entry.past] + \
                [outputs[i] for i in entry.outputs if i < len(outputs)]
            key = id(running)
            if key not in _TRUSTED:     # the record leaves with its running maximum
                weakref.finalize(running, _TRUSTED.pop, key, None)
            _TRUSTED[key] = _Trusted(weakref.ref(running), _version(running), [
                (weakref.ref(t), _version(t)) for t in tensors
                if isinstance(t, torch.Tensor) and _version(t) is not None])
