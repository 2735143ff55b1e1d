"""Which tensors a compiled graph's last call left behind, and whether they are untouched since.

A ``VersionRecord`` holds, for a list of tensors, a weak reference to each and its in-place
version counter (and storage pointer: ``p.data = t`` swaps the storage without a write) as
they were after a call. ``holds(tensors)`` says whether every tensor given is the very one
recorded in its slot and unchanged since: then nothing the record covers changed — no
optimizer step, ``load_state_dict``, cache edit or reset — and a call may skip the host work
that only such a change requires (``runtime.GraphRuntime``: the weights' refresh and the
cached keys' trust check). It is one flat loop, a few hundred nanoseconds per tensor.

A tensor whose version cannot be read (created in inference mode) never holds: callers then
take their full path every call, which is always correct.

    >>> w = torch.zeros(3)
    >>> record = VersionRecord()
    >>> record.update([w])
    >>> record.holds([w]), record.holds([torch.zeros(3)])
    (True, False)
    >>> _ = w.add_(1.0)
    >>> record.holds([w])
    False
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

__all__ = ["VersionRecord", "tensor_version"]


def tensor_version(t: Any) -> int | None:
    """``t._version``, or None for what has none (inference-mode tensors, non-tensors)."""
    try:
        return t._version
    except (AttributeError, RuntimeError):
        return None


def _dead() -> None:
    return None


_DEAD = _dead     # the reference of a slot that holds no tensor: never matches one


class VersionRecord:
    """Weak references, versions and storage pointers of a list of tensors after a call.

    Updated in place (``update``), so that whoever keeps the record (``key_norm_trust``'s
    owners) sees the latest call; references are reused while the tensors stay the same
    objects, so a decode loop over one cache allocates nothing per step."""

    __slots__ = ("refs", "versions", "pointers", "valid", "__weakref__")

    def __init__(self):
        self.refs: list[weakref.ref] = []
        self.versions: list[int | None] = []
        self.pointers: list[int] = []
        self.valid = False

    def update(self, tensors: Sequence[Any], start: int = 0) -> None:
        """Record ``tensors`` as they are now; with ``start``, only the slots from ``start``
        on (the caller knows the first ones are unchanged: the same tensors, not written)."""
        if start and len(self.refs) != len(tensors):
            start = 0
        refs = self.refs[:start]
        for ref, t in zip(self.refs[start:] + [None] * (len(tensors) - len(self.refs)),
                          tensors[start:]):
            refs.append(ref if ref is not None and ref() is t else
                        weakref.ref(t) if isinstance(t, torch.Tensor) else _DEAD)
        tail = tensors[start:]
        self.refs = refs
        self.versions = self.versions[:start] + [tensor_version(t) for t in tail]
        self.pointers = self.pointers[:start] + [
            t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in tail]
        self.valid = None not in self.versions

    def holds(self, tensors: Sequence[torch.Tensor], slots: Sequence[int] | None = None
              ) -> bool:
        """Whether ``tensors[i]`` is the tensor of slot ``slots[i]`` (default ``i``), with the
        version and storage it had then."""
        if not self.valid:
            return False
        slots = range(len(tensors)) if slots is None else slots
        if len(slots) != len(tensors):
            return False
        refs, versions, pointers = self.refs, self.versions, self.pointers
        try:
            return all(refs[s]() is t and t._version == versions[s] and
                       t.data_ptr() == pointers[s] for s, t in zip(slots, tensors))
        except (AttributeError, RuntimeError, IndexError):
            return False

    def holds_slot(self, slot: int, tensor: Any) -> bool:
        """Whether ``tensor`` is the one of ``slot``, unchanged since."""
        return self.valid and slot < len(self.refs) and self.refs[slot]() is tensor and \
            tensor_version(tensor) == self.versions[slot]
