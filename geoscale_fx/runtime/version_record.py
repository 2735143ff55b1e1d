"""Which tensors a compiled graph's last call left behind, and whether they are untouched since.

A ``VersionRecord`` holds, for a list of tensors, a weak reference to each and its in-place
version counter (and storage pointer: ``p.data = t`` swaps the storage without a write) as
they were after a call. ``holds(tensors)`` says whether every tensor given is the very one
recorded in its slot and unchanged since: then nothing the record covers changed — no
optimizer step, ``load_state_dict``, cache edit or reset — and a call may skip the host work
that only such a change requires (``runtime.GraphRuntime``: the weights' refresh and the
cached keys' trust check). It is one flat loop, about 0.1–0.2 µs per tensor (a weak
reference, ``_version`` and ``data_ptr()`` read each); ``holds_args`` reads the tensors
straight from a call's arguments, and ``reread`` takes only the new versions after a call
that wrote the recorded tensors in place (a StaticCache, a running maximum).

A tensor whose version cannot be read (created in inference mode) never holds: callers then
take their full path every call, which is always correct.

    >>> w = torch.zeros(3)
    >>> record = VersionRecord()
    >>> record.update([w])
    >>> record.holds([w], [0]), record.holds([torch.zeros(3)], [0])
    (True, False)
    >>> _ = w.add_(1.0)
    >>> record.holds([w], [0])
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

    def update(self, tensors: Sequence[Any]) -> None:
        """Record ``tensors`` as they are now (the lists are reused while the count stays)."""
        n = len(tensors)
        if len(self.refs) != n:
            self.refs, self.versions, self.pointers = [_DEAD] * n, [None] * n, [0] * n
        refs, versions, pointers = self.refs, self.versions, self.pointers
        for i in range(n):
            t = tensors[i]
            if refs[i]() is not t:
                refs[i] = weakref.ref(t) if isinstance(t, torch.Tensor) else _DEAD
            versions[i] = tensor_version(t)
            pointers[i] = t.data_ptr() if isinstance(t, torch.Tensor) else 0
        self.valid = None not in versions

    def reread(self) -> None:
        """After a call that may have written the recorded tensors in place (and that the
        caller checked them all before, with ``holds``): read their versions again. The
        storage pointers are kept: a storage swapped during the call then breaks the next
        ``holds``, which is the safe side."""
        try:
            self.versions = [r()._version for r in self.refs]
        except (AttributeError, RuntimeError):   # a tensor died, or keeps no version
            self.valid = False

    def holds(self, tensors: Sequence[torch.Tensor], slots: Sequence[int]) -> bool:
        """Whether ``tensors[i]`` is the tensor of slot ``slots[i]``, with the version and
        storage it had then."""
        if not self.valid or len(slots) != len(tensors):
            return False
        refs, versions, pointers = self.refs, self.versions, self.pointers
        try:
            for s, t in zip(slots, tensors):
                if refs[s]() is not t or t._version != versions[s] or \
                        t.data_ptr() != pointers[s]:
                    return False
        except (AttributeError, RuntimeError, IndexError):
            return False
        return True

    def holds_args(self, args: Sequence[Any], positions: Sequence[int]) -> bool:
        """``holds`` for ``args[positions[i]]`` in slot ``i``, every slot: the per-call check
        of the tensors a call passes at fixed positions (no list built)."""
        if not self.valid or len(positions) != len(self.refs):
            return False
        try:
            for p, r, v, ptr in zip(positions, self.refs, self.versions, self.pointers):
                t = args[p]
                if r() is not t or t._version != v or t.data_ptr() != ptr:
                    return False
        except (AttributeError, RuntimeError, IndexError):
            return False
        return True

    def holds_slot(self, slot: int, tensor: Any) -> bool:
        """Whether ``tensor`` is the one of ``slot``, unchanged since."""
        return self.valid and slot < len(self.refs) and self.refs[slot]() is tensor and \
            tensor_version(tensor) == self.versions[slot]
