"""``geoscale_fx.runtime.version_record``: a record holds exactly while every tensor is the recorded
object with the recorded version counter and storage; anything else — an in-place write, a
new object, a swapped storage, a tensor without a version counter — breaks it."""
from __future__ import annotations

import gc

import torch

from geoscale_fx.runtime.version_record import VersionRecord, storage_key, tensor_version


def _recorded(*tensors) -> VersionRecord:
    record = VersionRecord()
    record.update(list(tensors))
    return record


def test_unchanged_tensors_hold_in_any_slot_order_asked():
    a, b = torch.zeros(3), torch.ones(2)
    record = _recorded(a, b)
    assert record.holds([a, b], [0, 1])
    assert record.holds([b], [1]) and record.holds([b, a], [1, 0])
    assert not record.holds([a, b], [1, 0])           # each tensor is checked in its slot


def test_an_in_place_write_a_new_object_or_a_swapped_storage_breaks_it():
    a = torch.zeros(3)
    record = _recorded(a)
    a.add_(1.0)
    assert not record.holds([a], [0])
    record.update([a])
    assert record.holds([a], [0])
    assert not record.holds([a.clone()], [0])         # equal values, another tensor
    p = torch.nn.Parameter(torch.zeros(3))
    record.update([p])
    with torch.no_grad():
        p.data = torch.ones(3)                       # no write: the storage is replaced
    assert not record.holds([p], [0])


def test_a_freed_tensor_never_matches_its_successor_at_the_same_address():
    record = _recorded(torch.zeros(4))
    gc.collect()
    assert not record.holds([torch.zeros(4)], [0])


def test_inference_mode_tensors_and_non_tensors_never_hold():
    with torch.inference_mode():
        t = torch.zeros(2)
    assert tensor_version(t) is None and tensor_version(3) is None
    record = _recorded(t)
    assert not record.valid and not record.holds([t], [0])
    record = _recorded(torch.zeros(1), None)
    assert not record.holds([record.refs[0]()], [0])


def test_an_update_after_a_write_and_a_new_cache_tensor_rereads_every_slot():
    w, cache = torch.zeros(2), torch.zeros(5)
    record = _recorded(w, cache)
    cache[0] = 1.0                                   # the call wrote the cache
    record.update([w, cache])
    assert record.holds([w, cache], [0, 1])
    new_cache = torch.zeros(5)                        # a DynamicCache's next tensor
    record.update([w, new_cache])
    assert record.holds([new_cache], [1]) and not record.holds([cache], [1])
    assert not record.holds([w, new_cache], [0])      # slots and tensors must pair up


def test_holds_args_checks_the_tensor_at_each_position_against_its_slot():
    w, b = torch.zeros(3), torch.ones(2)
    record = _recorded(w, b)
    args = (torch.zeros(1), w, "x", b)
    assert record.holds_args(args, (1, 3))
    assert not record.holds_args(args, (3, 1))                  # order: slot i ← positions[i]
    assert not record.holds_args(args, (1,))                    # every slot, or it fails
    assert not _recorded(w).holds_args((w.view(3),), (0,))      # a view: storage, version alike
    assert not record.holds_args(args, (1, 9))                  # a missing argument
    b.add_(1.0)
    assert not record.holds_args(args, (1, 3))
    p = torch.nn.Parameter(torch.zeros(3))
    record.update([p])
    with torch.no_grad():
        p.data = torch.ones(3)
    assert not record.holds_args((p,), (0,))


def test_reread_takes_the_new_versions_of_the_same_tensors_and_nothing_else():
    """After a call that wrote its recorded tensors in place (a StaticCache, a running
    maximum): ``reread`` makes the record hold them again; a storage swapped meanwhile
    still breaks it, and a tensor that died leaves the record invalid."""
    running, cache = torch.zeros(2), torch.zeros(4)
    record = _recorded(running, cache)
    refs = list(record.refs)
    running.add_(1.0)
    cache[1] = 3.0
    assert not record.holds([running, cache], [0, 1])
    record.reread()
    assert record.holds([running, cache], [0, 1])
    assert all(a is b for a, b in zip(record.refs, refs))      # the same references kept
    with torch.no_grad():
        cache.data = torch.zeros(4)
    record.reread()
    assert not record.holds([running, cache], [0, 1])
    del cache
    gc.collect()
    record.reread()
    assert not record.valid and not record.holds([running], [0])


def test_same_asks_identity_only_holds_asks_contents_too():
    """``same``: the very tensors, whatever was written since (an update is no rebind);
    another object or another count is not the same."""
    a, b = torch.zeros(3), torch.ones(2)
    record = _recorded(a, b)
    a.add_(1.0)
    assert record.same([a, b]) and not record.holds([a, b], [0, 1])
    assert not record.same([a.clone(), b]) and not record.same([a]) and not record.same([b, a])
    p = torch.nn.Parameter(torch.zeros(3))
    record.update([p])
    with torch.no_grad():
        p.data = torch.ones(3)
    assert record.same([p]) and not record.holds([p], [0])
    with torch.inference_mode():
        t = torch.zeros(2)
    record.update([t])
    assert record.same([t]) and not record.holds([t], [0])      # no version: never holds


def test_holds_slot_sees_a_swapped_storage_like_holds():
    p = torch.nn.Parameter(torch.zeros(3))
    record = _recorded(torch.zeros(1), p)
    assert record.holds_slot(1, p) and not record.holds_slot(0, p) and not record.holds_slot(5, p)
    with torch.no_grad():
        p.data = torch.ones(3)
    assert not record.holds_slot(1, p)


class _Wrapped(torch.Tensor):
    """A wrapper subclass without storage whose ``data_ptr`` raises (as a DTensor's did in
    older torch builds); its values are its inner tensor's."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    def data_ptr(self):
        raise RuntimeError("this tensor has no storage")

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _Wrapped(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


class _Opaque(_Wrapped):
    """The same, naming no inner tensor: where its values live cannot be read."""

    def __tensor_flatten__(self):
        return [], None


def test_a_wrapper_without_storage_holds_by_its_inner_tensor():
    w = _Wrapped(torch.zeros(3))
    assert storage_key(w) == ((w.inner.data_ptr(), 0),)       # (pointer, version) per inner
    record = _recorded(torch.zeros(1), w)
    assert record.valid and record.holds([w], [1]) and record.holds_slot(1, w)
    assert _recorded(w).holds_args(("x", w), (1,))
    torch.autograd.graph.increment_version(w)                            # an in-place write
    assert not record.holds([w], [1]) and not record.holds_slot(1, w)
    record.update([torch.zeros(1), w])
    w.inner = torch.ones(3)                                              # another local shard
    assert not record.holds([w], [1]) and not _recorded(w).holds([_Wrapped(w.inner)], [0])
    record.update([torch.zeros(1), w])
    w.inner.add_(1.0)                              # a write past the wrapper's own counter
    assert not record.holds([w], [1])
    opaque = _Opaque(torch.zeros(3))
    assert storage_key(opaque) is None
    record = _recorded(opaque)
    assert not record.valid and not record.holds([opaque], [0]) and record.same([opaque])


def test_a_dtensor_holds_until_written_or_its_local_shard_is_swapped(one_rank_mesh):
    """A DTensor parameter (one-rank gloo mesh): its wrapper has no storage (``data_ptr()``
    0); the record follows its local shard, so an unchanged one holds (the fast path) and an
    optimizer-style in-place step, a write into the shard (``dcp.load``: the wrapper's
    version counter stays) or a new local shard (``fully_shard``'s reset) breaks it."""
    from torch.distributed.tensor import DTensor, Shard

    p = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 2), one_rank_mesh, [Shard(0)]))
    assert p.data_ptr() == 0 and storage_key(p) == ((p.to_local().data_ptr(), 0),)
    record = _recorded(p)
    assert record.holds([p], [0]) and record.holds_args((p,), (0,))
    with torch.no_grad():
        p.mul_(2.0)
    assert not record.holds([p], [0])
    record.update([p])
    assert record.holds([p], [0])
    version = p._version
    with torch.no_grad():
        p.to_local().mul_(2.0)
    assert p._version == version and not record.holds([p], [0])
    record.update([p])
    p._local_tensor = torch.randn(4, 2)
    assert not record.holds([p], [0]) and not record.holds_args((p,), (0,)) and record.same([p])
