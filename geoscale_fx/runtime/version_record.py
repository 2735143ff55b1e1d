"""Which tensors a call left behind, and whether they are the same and untouched since.

The one answer to "did these tensors change" for the runtime's weights and cached keys
(``runtime.GraphRuntime``, ``runtime.key_norm_trust``) and for the parameters of the
KV-cache scales (``kv_cache.weight_scales``). A ``VersionRecord`` holds, for a list of
tensors, a weak reference to each, its in-place version counter and its storage key
(``storage_key``: where its values live, as ``p.data = t`` swaps the storage without a
write) as they were when recorded. It answers two questions:

* ``same(tensors)``: whether they are the very tensors recorded, slot by slot — identity
  only. A parameter replaced by another tensor (``load_state_dict(assign=True)``, a new
  ``nn.Parameter``) breaks it; an in-place write does not (a *rebind*, not an update);
* ``holds(tensors, slots)``: the very tensors, each with the version and storage it had
  then: nothing the record covers changed — no optimizer step, ``load_state_dict``, cache
  edit or reset — and the caller may skip the host work that only such a change requires
  (the weights' refresh, the cached keys' trust check, the KV-cache bounds).

``holds`` is one flat loop, about 0.1–0.2 µs per plain tensor (a weak reference,
``_version`` and ``data_ptr()`` read each); ``holds_args`` reads the tensors straight from
a call's arguments, and ``reread`` takes only the new versions after a call that wrote the
recorded tensors in place (a StaticCache, a running maximum). A DTensor costs about 1 µs
more (its local shard is looked up).

A tensor whose version cannot be read (created in inference mode) never holds, nor does one
whose storage cannot be located (``storage_key`` is None): callers then take their full
path every call, which is always correct. A write through ``.data`` in place bypasses the
version counter and is not seen. Nor would a fused optimizer step (``AdamW(fused=True)``,
transformers' default optimizer), which leaves the counters as they were: the first record
registers ``optimizer_steps.follow_optimizer_steps``, which bumps them after every step.

    >>> w = torch.zeros(3)
    >>> record = VersionRecord()
    >>> record.update([w])
    >>> record.holds([w], [0]), record.holds([torch.zeros(3)], [0])
    (True, False)
    >>> _ = w.add_(1.0)
    >>> record.holds([w], [0]), record.same([w])
    (False, True)
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence, Union

import torch

from geoscale_fx.runtime.optimizer_steps import follow_optimizer_steps

__all__ = ["VersionRecord", "storage_key", "tensor_version"]

#: where a tensor's values live (see ``storage_key``)
StorageKey = Union[int, tuple, None]


def tensor_version(t: Any) -> int | None:
    """``t._version``, or None for what has none (inference-mode tensors, non-tensors)."""
    try:
        return t._version
    except (AttributeError, RuntimeError):
        return None


def storage_key(t: torch.Tensor) -> StorageKey:
    """Where ``t``'s values live, equal while they stay there: ``t.data_ptr()``.

    A wrapper subclass without storage of its own (a DTensor: its ``data_ptr()`` is 0, or
    raises in some builds) keeps its values in the inner tensors it flattens to
    (``__tensor_flatten__``: a DTensor's local shard): its key is ``(pointer, version)`` of
    each, so a new local shard (``fully_shard``'s ``reset_sharded_param``) and a write into
    the shard that leaves the wrapper's own version counter as it was (``dcp.load`` into the
    parameters) are both seen. None where neither can be read (a subclass naming no inner
    tensor, a shard without a version counter): a slot holding it never holds.

        >>> t = torch.zeros(2)
        >>> storage_key(t) == t.data_ptr()
        True
    """
    try:
        pointer = t.data_ptr()
    except RuntimeError:
        pointer = None
    if pointer or type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return pointer
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return None
    key = []
    for name in flatten(t)[0]:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            where, version = storage_key(inner), tensor_version(inner)
            if where is None or version is None:
                return None
            key.append((where, version))
    return tuple(key) or None


def _dead() -> None:
    return None


_DEAD = _dead     # the reference of a slot that holds no tensor: never matches one


class VersionRecord:
    """Weak references, versions and storage keys of a list of tensors.

    Updated in place (``update``), so that whoever keeps the record (``key_norm_trust``'s
    owners) sees the latest call; references are reused while the tensors stay the same
    objects, so a decode loop over one cache allocates nothing per step. ``valid`` is False
    until the first ``update``, after one that saw a tensor without a version or storage
    key, or when a caller sets it (refresh on the next call)."""

    __slots__ = ("refs", "versions", "storages", "valid", "__weakref__")

    def __init__(self):
        follow_optimizer_steps()
        self.refs: list[weakref.ref] = []
        self.versions: list[int | None] = []
        self.storages: list[StorageKey] = []
        self.valid = False

    def update(self, tensors: Sequence[Any]) -> None:
        """Record ``tensors`` as they are now (the lists are reused while the count stays)."""
        n = len(tensors)
        if len(self.refs) != n:
            self.refs, self.versions, self.storages = [_DEAD] * n, [None] * n, [0] * n
        refs, versions, storages = self.refs, self.versions, self.storages
        for i in range(n):
            t = tensors[i]
            if refs[i]() is not t:
                refs[i] = weakref.ref(t) if isinstance(t, torch.Tensor) else _DEAD
            try:
                versions[i] = t._version
                storages[i] = t.data_ptr() or storage_key(t)
            except (AttributeError, RuntimeError):  # inference mode, no storage, no tensor
                versions[i] = tensor_version(t)
                storages[i] = storage_key(t) if isinstance(t, torch.Tensor) else 0
        self.valid = None not in versions and None not in storages

    def reread(self) -> None:
        """After a call that may have written the recorded tensors in place (and that the
        caller checked them all before, with ``holds``): read their versions again. The
        storage keys are kept: a storage swapped during the call then breaks the next
        ``holds``, which is the safe side (so does a write into a DTensor's local shard)."""
        try:
            self.versions = [r()._version for r in self.refs]
        except (AttributeError, RuntimeError):   # a tensor died, or keeps no version
            self.valid = False

    def same(self, tensors: Sequence[Any]) -> bool:
        """Whether ``tensors`` are the very tensors recorded, slot by slot and as many:
        identity only, whatever was written to them since (an in-place update is not a
        rebind)."""
        refs = self.refs
        if len(tensors) != len(refs):
            return False
        for r, t in zip(refs, tensors):
            if r() is not t:
                return False
        return True

    def holds(self, tensors: Sequence[torch.Tensor], slots: Sequence[int]) -> bool:
        """Whether ``tensors[i]`` is the tensor of slot ``slots[i]``, with the version and
        storage it had then."""
        if not self.valid or len(slots) != len(tensors):
            return False
        refs, versions, storages = self.refs, self.versions, self.storages
        try:
            for s, t in zip(slots, tensors):
                if refs[s]() is not t or t._version != versions[s] or (
                        t.data_ptr() != storages[s] and storage_key(t) != storages[s]):
                    return False
        except (AttributeError, IndexError):
            return False
        except RuntimeError:          # no version, or a data_ptr() that raises: with care
            return all(self._unchanged(s, t) for s, t in zip(slots, tensors))
        return True

    def holds_args(self, args: Sequence[Any], positions: Sequence[int]) -> bool:
        """``holds`` for ``args[positions[i]]`` in slot ``i``, every slot: the per-call check
        of the tensors a call passes at fixed positions (no list built)."""
        if not self.valid or len(positions) != len(self.refs):
            return False
        try:
            for p, r, v, key in zip(positions, self.refs, self.versions, self.storages):
                t = args[p]
                if r() is not t or t._version != v or (
                        t.data_ptr() != key and storage_key(t) != key):
                    return False
        except (AttributeError, IndexError):
            return False
        except RuntimeError:
            return all(self._unchanged(i, args[p]) for i, p in enumerate(positions))
        return True

    def holds_slot(self, slot: int, tensor: Any) -> bool:
        """Whether ``tensor`` is the one of ``slot``, with the version and storage it had."""
        return self.valid and self._unchanged(slot, tensor)

    def _unchanged(self, slot: int, tensor: Any) -> bool:
        """``holds`` for one slot, reading what may raise with care (tensors without a
        version counter, or whose ``data_ptr()`` raises)."""
        if slot >= len(self.refs):
            return False
        version, key = self.versions[slot], self.storages[slot]
        return self.refs[slot]() is tensor and version is not None and key is not None \
            and tensor_version(tensor) == version and storage_key(tensor) == key
