"""The host side of incremental cached keys: which cache tensors a running maximum covers.

A site whose keys come from a cache that is only moved (``analysis.forms.cached_keys``) measures only
this call's new keys in the graph and keeps ``key_norm_max``, the running per-key-head
maximum of everything written before. That maximum covers a cache tensor only if every entry
of the tensor went through the graph. After each call of a compiled graph, the runtime keeps
a ``VersionRecord`` of what the call left: each running maximum, and the cache tensors the
graph read and wrote (the past placeholders, mutated in place by a StaticCache, and the graph
outputs that are the key or a slice of it, or the tensor whose heads the key repeats (GQA's
``repeat_kv``): a DynamicCache's ``cat``), each with its in-place version counter. The graph
that last wrote a running maximum is its *owner* (``_OWNERS``: the record and the slots of
that maximum and of its caches in it).

Before a call, a past cache tensor is *trusted* when the owner's record holds it, unchanged
since (same version), and holds the running maximum unchanged too (no other cache, checkpoint
load or cold start has rewritten it since). Otherwise — a fresh cache, a cache the user
passed or edited, a beam reorder or crop that built a new tensor, a reset — the host measures
the past tensors (``key_head_norms``, O(cache), once) and *replaces* the running maximum with
that measurement before the graph runs. So the bound holds for whatever the cache holds, and
a decode loop pays O(new tokens) per step.

The runtime's fast path: when its own record holds every running maximum and every past
cache of this call (``holds``: ``watched`` against the layout's ``next_call`` slots), nothing
changed since its last call and this graph is still the owner, so neither ``before`` nor
``after`` has anything to do; ``recorded`` brings the record up to date after the call
(without stored keys, as for a StaticCache, the same tensors written in place: only their
versions are read again). What the runtime calls, and the record's layout, are
``runtime.key_trust_protocol``'s ``KeyTrust`` and ``RecordLayout``.

A write through ``.data`` bypasses version counters and is not seen (as for the weights: see
the README's inference section); inference-mode tensors keep no version counter, so their
caches are re-measured every call (correct, O(cache)).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from geoscale_fx.numerics.head_weights import key_head_norms
from geoscale_fx.analysis.forms.cached_keys import (WHOLE_COPIES, repeated_kv_heads,
                                                     whole_vector_slices)
from geoscale_fx.analysis.fx.graph_ops import op_of
from geoscale_fx.sites.terms import Side
from geoscale_fx.runtime.key_trust_protocol import RecordLayout
from geoscale_fx.runtime.version_record import VersionRecord

__all__ = ["KeyNormTrust"]

log = logging.getLogger("geoscale_fx")


@dataclass(frozen=True)
class _Owner:
    """The graph that last wrote a running maximum: its record (weakly) and the slots there
    of the maximum and of the caches it covers."""
    record: weakref.ref
    running: int
    caches: tuple[int, ...]

    def covers(self, running: torch.Tensor, caches: Sequence[Any]) -> bool:
        record: Optional[VersionRecord] = self.record()
        return record is not None and record.holds_slot(self.running, running) and all(
            any(record.holds_slot(slot, cache) for slot in self.caches) for cache in caches)


def _said_nonfinite(heads: int) -> None:
    """A past cache handed in with keys that are not finite (bits of someone else's FP8
    cache, NaN activations): the bound over them is not finite either. Counted
    (``counters["geoscale"]["nonfinite_cached_keys"]``) and said once per process."""
    counters["geoscale"]["nonfinite_cached_keys"] += 1
    if counters["geoscale"]["nonfinite_cached_keys"] == 1:
        log.warning("geoscale: a past KV cache holds keys that are not finite (%d key "
                    "head(s) with NaN/inf): their logit bound and the attention's output are "
                    "not finite; check the cache (its bits, or the activations that wrote "
                    "it)", heads)


def _held_whole(key: Node) -> frozenset[str]:
    """The names of the nodes every entry of which ``key`` holds: the key, and what it is a
    copy of (``contiguous``, ``clone``, ``detach``) or repeats whole heads of (GQA's
    ``repeat_kv``, ``analysis.forms.cached_keys.repeated_kv_heads``: key head ``h`` is head
    ``h // r`` of it). A running maximum that covers the key covers each of them, read with
    that repeat. Never through a slice (it drops entries) nor a cast (it rounds them)."""
    names = []
    node: Any = key
    while isinstance(node, Node):
        names.append(node.name)
        repeated = repeated_kv_heads(node)
        if repeated is not None:
            node = repeated[0]
        elif op_of(node) in WHOLE_COPIES:
            node = node.args[0]
        else:
            break
    return frozenset(names)


def _stored_from(node: Node, held: frozenset[str]) -> bool:
    """``node`` is one of the ``held`` nodes (``_held_whole``), or a whole-vector
    slice/copy of one (a cache keeps it)."""
    while True:
        if node.name in held:
            return True
        op = op_of(node)
        moved = op in WHOLE_COPIES or (
            op == "getitem" and whole_vector_slices(node.args[1]))   # heads stay in place
        if moved and isinstance(node.args[0], Node):
            node = node.args[0]
            continue
        return False


#: id of a running maximum -> its owner, the graph that wrote it last (dropped when the
#: tensor dies; the prefill graph's cache is trusted by the decode graph's first call)
_OWNERS: dict[int, _Owner] = {}


@dataclass(frozen=True)
class _Entry:
    site: int                     # index among the runtime's plans
    state: str                    # the running maximum's state name
    axes: tuple[int, int]         # (head axis, channel axis) of the keys
    past: tuple[tuple[int, int], ...]   # (graph-input position, head repeat) of past caches
    outputs: tuple[int, ...]      # graph-output positions that a cache stores


class KeyNormTrust:
    """For one compiled graph: before a call, re-measure untrusted caches; after it, own what
    the graph wrote. Empty (and free) for graphs without incremental keys. A
    ``key_trust_protocol.KeyTrust``; its record's slots are ``layout``'s."""

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
                key = by_name.get(side.source.node)
                held = _held_whole(key) if key is not None else frozenset()
                stored = tuple(i for i, o in enumerate(outputs)
                               if isinstance(o, Node) and _stored_from(o, held))
                self.entries.append(_Entry(index, name, side.observed_axes, past, stored))
        self.n_outputs = len(outputs)
        self.layout = RecordLayout.of([len(e.past) for e in self.entries],
                                      [len(e.outputs) for e in self.entries])
        # graph-input positions of the past caches, graph-output positions of the stored
        # keys: entry after entry, as the layout's slots
        self._past = [i for e in self.entries for i, _ in e.past]
        self._stored = [i for e in self.entries for i in e.outputs]
        self._record = VersionRecord()          # for callers that keep none (``after``)

    def runnings(self, states: Sequence[Any]) -> list[torch.Tensor]:
        return [getattr(states[e.site], e.state) for e in self.entries]

    def watched(self, args: Sequence[Any], runnings: Sequence[torch.Tensor]) -> list:
        """Before a call: the running maxima and the past caches (``next_call`` order)."""
        return [*runnings, *[args[i] for i in self._past]]

    def holds(self, args: Sequence[Any], runnings: Sequence[torch.Tensor],
              record: VersionRecord) -> bool:
        """Before a call: ``record`` (this graph's, as ``after`` left it) holds every running
        maximum and every past cache of this call, unchanged (true when there are none)."""
        if not self.entries:
            return True
        slots = self.layout.next_call
        return slots is not None and record.holds(self.watched(args, runnings), slots)

    def recorded(self, args: Sequence[Any], out: Any, runnings: Sequence[torch.Tensor],
                 record: VersionRecord) -> None:
        """After a call that ``holds`` let through: ``record`` as ``kept`` would give it.
        Without stored keys the kept tensors are the watched ones, in the record's order
        (``next_call`` is then every slot): their versions are read again, nothing else."""
        if self._stored:
            record.update(self.kept(args, out, runnings))
        elif self.entries:
            record.reread()

    def kept(self, args: Sequence[Any], out: Any, runnings: Sequence[torch.Tensor]) -> list:
        """After a call: the running maxima, the past caches and the stored keys (``layout``)."""
        if not self._stored:
            return [*runnings, *[args[i] for i in self._past]]
        outputs = out if isinstance(out, (tuple, list)) else [out]
        if len(outputs) != self.n_outputs:
            outputs = [None] * self.n_outputs
        return [*runnings, *[args[i] for i in self._past], *[outputs[i] for i in self._stored]]

    def before(self, args: Sequence[Any], states: Sequence[Any]) -> int:
        """Re-measure the past caches the running maxima do not cover; returns how many
        sites were re-measured."""
        measured = 0
        for entry in self.entries:
            running = getattr(states[entry.site], entry.state)
            owner = _OWNERS.get(id(running))
            caches = [(args[i], r) for i, r in entry.past]
            if owner is not None and owner.covers(running, [c for c, _ in caches]):
                continue
            with torch.no_grad():
                norms = torch.zeros_like(running)
                for cache, repeat in caches:
                    heads = key_head_norms(cache, entry.axes).repeat_interleave(repeat)
                    norms = torch.maximum(norms, heads.to(norms))
                if not bool(torch.isfinite(norms).all()):
                    _said_nonfinite(int((~torch.isfinite(norms)).sum()))
                running.copy_(norms)
            measured += 1
        return measured

    def after(self, args: Sequence[Any], out: Any, states: Sequence[Any],
              record: Optional[VersionRecord] = None) -> None:
        """Own the caches this call read and wrote, with the running maxima as they are:
        ``record`` (already updated by the caller with ``kept``), or a record of this
        object's own."""
        if not self.entries:
            return
        runnings = self.runnings(states)
        if record is None:
            record = self._record
            record.update(self.kept(args, out, runnings))
        ref = weakref.ref(record)
        layout = self.layout
        for index, running in enumerate(runnings):
            owner = _Owner(ref, layout.running[index], layout.caches(index))
            key = id(running)
            if key not in _OWNERS:     # the entry leaves with its running maximum
                weakref.finalize(running, _OWNERS.pop, key, None)
            _OWNERS[key] = owner
