"""What ``GraphRuntime`` asks of the cached keys' trust, and where the trust's tensors sit.

A site whose keys come from a cache carries a running maximum of the cached keys' norms
(``ExactObservedKeys.running_state``); the *trust* decides, around each call of a compiled
graph, whether that maximum still covers the past caches the call reads
(``runtime.key_norm_trust.KeyNormTrust`` is the one ``KeyTrust``). ``runtime.GraphRuntime``
calls it in two shapes, with the binding's ``VersionRecord`` (its only writer is the trust,
laid out as ``layout`` says)::

    fast path:  holds(args, runnings, record)             # True: nothing changed since
                out = graph(*args, *state)
                recorded(args, out, runnings, record)     # the record follows the call
    full path:  before(args, states)                      # re-measure untrusted caches
                out = graph(*args, *state)
                record.update(kept(args, out, runnings))  # in ``layout``'s order
                after(args, out, states, record)          # own what the call left

``runnings`` are the binding's running maxima (``runnings(states)``, read once per binding).
A graph without incremental keys has no ``entries``: ``holds`` is True and the rest is free.

The record's layout (``RecordLayout``): every entry's running maximum, then every entry's
past caches (graph inputs), then every entry's stored keys (graph outputs that are the key
or a whole-vector slice of it, or the tensor whose heads the key repeats (GQA's ``repeat_kv``,
as transformers writes it whenever it passes SDPA a mask): what a DynamicCache keeps), each in
entry order.

    >>> layout = RecordLayout.of(past=(1, 1), stored=(1, 1))      # two DynamicCache layers
    >>> layout.running, layout.past, layout.stored, layout.next_call
    ((0, 1), ((2,), (3,)), ((4,), (5,)), (0, 1, 4, 5))
    >>> RecordLayout.of(past=(1,), stored=(0,)).next_call           # a StaticCache
    (0, 1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch

from geoscale_fx.runtime.version_record import VersionRecord

__all__ = ["KeyTrust", "RecordLayout"]


@dataclass(frozen=True)
class RecordLayout:
    """The record's slots, per entry: its running maximum, its past caches, its stored keys.

    ``next_call``: the slots the next call's watched tensors (the running maxima, then every
    past cache, as ``holds`` lists them) are checked against — this call's stored keys (a
    DynamicCache's ``cat``: the next past is this key) or, without stored keys, the same past
    tensors written in place (a StaticCache). None when an entry stores a number of keys
    other than its past caches': no one-to-one continuation, no fast path."""
    running: tuple[int, ...]
    past: tuple[tuple[int, ...], ...]
    stored: tuple[tuple[int, ...], ...]
    next_call: Optional[tuple[int, ...]]

    @classmethod
    def of(cls, past: Sequence[int], stored: Sequence[int]) -> "RecordLayout":
        """The layout of entries with ``past[i]`` past caches and ``stored[i]`` stored keys."""
        n = len(past)
        past_at, stored_at = n, n + sum(past)
        past_slots, stored_slots = [], []
        next_call: Optional[list[int]] = list(range(n))
        for n_past, n_out in zip(past, stored):
            past_slots.append(tuple(range(past_at, past_at + n_past)))
            stored_slots.append(tuple(range(stored_at, stored_at + n_out)))
            if next_call is not None and n_out in (0, n_past):
                next_call += stored_slots[-1] if n_out else past_slots[-1]
            else:
                next_call = None
            past_at, stored_at = past_at + n_past, stored_at + n_out
        return cls(tuple(range(n)), tuple(past_slots), tuple(stored_slots),
                   None if next_call is None else tuple(next_call))

    @property
    def size(self) -> int:
        return len(self.running) + sum(map(len, self.past)) + sum(map(len, self.stored))

    def caches(self, entry: int) -> tuple[int, ...]:
        """The slots of ``entry``'s caches: its past ones, then its stored keys."""
        return self.past[entry] + self.stored[entry]


@runtime_checkable
class KeyTrust(Protocol):
    """The cached keys' trust of one compiled graph, as ``GraphRuntime`` calls it.

    ``args`` are a call's graph inputs, ``out`` its outputs, ``states`` the binding's site
    states (``SiteState``, in plan order), ``record`` the binding's ``VersionRecord``."""

    #: one per running maximum of the graph (empty: nothing to trust, every call is free)
    entries: Sequence[Any]
    #: where ``kept`` puts each tensor in the record
    layout: RecordLayout

    def runnings(self, states: Sequence[Any]) -> list[torch.Tensor]:
        """The running maxima in ``states``, one per entry (the runtime reads them once per
        binding: the state tensors live as long as it)."""
        ...

    def holds(self, args: Sequence[Any], runnings: Sequence[torch.Tensor],
              record: VersionRecord) -> bool:
        """Before a call: whether ``record`` (as ``after`` or ``recorded`` left it) holds every
        running maximum and past cache of this call, unchanged — then ``before`` and
        ``after`` would have nothing to do. True without entries. No allocation beyond the
        list it checks: a decode loop calls it every step."""
        ...

    def recorded(self, args: Sequence[Any], out: Any, runnings: Sequence[torch.Tensor],
                 record: VersionRecord) -> None:
        """After a call that ``holds`` let through: bring ``record`` to what ``kept`` would
        give (the graph wrote the caches and maxima in place, or stored new keys)."""
        ...

    def before(self, args: Sequence[Any], states: Sequence[Any]) -> int:
        """Before a full call: measure on the host every past cache no running maximum
        covers and replace that maximum with the measurement; returns how many sites were
        measured."""
        ...

    def kept(self, args: Sequence[Any], out: Any, runnings: Sequence[torch.Tensor]) -> list:
        """After a full call: the tensors to record, in ``layout``'s order."""
        ...

    def after(self, args: Sequence[Any], out: Any, states: Sequence[Any],
              record: Optional[VersionRecord] = None) -> None:
        """After a full call, ``record`` updated with ``kept``: own the running maxima, so
        that a later call of any graph trusts the caches this one read and wrote while
        ``record`` holds them."""
        ...
