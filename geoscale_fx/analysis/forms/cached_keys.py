"""Where a cached key tensor's entries come from: earlier cache contents, or this call's keys.

A decode step's keys are bounded by their actual norms (``Side.observed``). Measuring the
whole cache every step costs O(cache); but a KV cache is only ever *moved* (concatenated,
written at positions, sliced, reordered) — its entries are the entries of the past cache
tensors (graph inputs) and of the keys this call computes. ``key_sources`` finds that
decomposition on the graph:

    key  =  data movement of  { past: cache placeholders,  fresh: this call's key tensors }

with every op on the way moving whole key vectors (GQA's ``repeat_kv`` repeats whole heads) (the channel axis and the head axis are
never mixed), so ``max_j ‖k_g,j‖ ≤ max(max over past, max over fresh)`` per key head g. The
past part is a running maximum kept in the site's state (``key_norm_max``) and trusted only
for cache tensors this graph wrote (``geoscale_fx.runtime.key_norm_trust``); the fresh part is
measured in the graph, O(new tokens).

Recognized, on a 4-D ``(batch, heads, positions, d_h)`` key: ``cat`` along batch or
positions, ``getitem`` with slices that keep heads and channels whole, ``contiguous``,
``clone``, ``detach``, same-dtype casts; writes into a past placeholder by ``index_copy_``
along batch or positions, before the attention. Anything else makes the node a fresh leaf
(measured as it is: correct, O(its size)); an unknown in-place write to a past tensor, a
write after the attention, or a leaf of another layout or dtype gives None (the caller
measures the whole key every step, as before).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import ValueKinds, arg, example_value, op_of

__all__ = ["KeySources", "key_sources", "whole_vector_slices", "repeated_kv_heads",
           "WHOLE_COPIES"]

#: data-movement ops that keep every key vector whole (checked further per op)
WHOLE_COPIES = frozenset({"contiguous", "clone", "detach"})
#: axes a move may act on: batch and positions (never heads: per-head maxima; never channels)
_MOVABLE = (0, 2)
#: views whose in-place writes also write the tensor they view
_VIEWS = frozenset({"view", "reshape", "transpose", "permute", "getitem", "narrow", "select",
                    "squeeze", "unsqueeze", "flatten", "unflatten", "expand", "movedim",
                    "view_as", "t", "split", "chunk", "unbind"})


@dataclass(frozen=True)
class KeySources:
    """The key's entries are entries of ``past`` (cache placeholders) and ``fresh`` nodes,
    each ``(node name, r)``: key head ``h`` holds that node's head ``h // r`` (``r > 1``: a
    GQA ``repeat_kv`` between the cache and the attention)."""
    past: tuple[tuple[str, int], ...]
    fresh: tuple[tuple[str, int], ...]


class _Refused(Exception):
    pass


def _axis(dim, ndim: int = 4) -> int:
    if not isinstance(dim, int):
        raise _Refused
    return dim % ndim


def _is_inplace(node: Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    return node.op == "call_function" and node.target in (operator.setitem,)


def whole_vector_slices(index) -> bool:
    """``x[a, b, c, d]`` with slices only, heads (dim 1) and channels (dim 3) untouched."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index) or len(index) > 4:
        return False
    if not all(isinstance(i, slice) for i in index):
        return False
    full = slice(None)
    return all(i == full for d, i in enumerate(index) if d in (1, 3))


class _Walk:
    def __init__(self, attention: Node, kinds: ValueKinds, shape: tuple, dtype):
        self.kinds, self.n_heads, self.d_h, self.dtype = kinds, shape[1], shape[3], dtype
        self.order = {n: i for i, n in enumerate(attention.graph.nodes)}
        self.attention = attention
        self.past: dict[tuple[str, int], None] = {}
        self.fresh: dict[tuple[str, int], None] = {}

    def _check(self, value, repeat: int) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() != 4 or \
                value.shape[1] * repeat != self.n_heads or value.shape[3] != self.d_h or \
                value.dtype != self.dtype:
            raise _Refused

    def _leaf(self, node: Node, repeat: int) -> None:
        self._check(example_value(node), repeat)
        self.fresh[(node.name, repeat)] = None

    def visit(self, node, repeat: int = 1) -> None:
        if not isinstance(node, Node):
            raise _Refused
        value = example_value(node)
        if not isinstance(value, torch.Tensor) or value.dim() != 4:
            raise _Refused
        if node.op == "placeholder" and not self.kinds.is_param(node):
            self._past(node, repeat)
            return
        op = op_of(node)
        repeated = repeated_kv_heads(node)
        if node.op == "call_method" and node.target == "index_copy_":
            self.visit(node.args[0], repeat)  # the written cache itself (its writes: _past)
        elif repeated is not None:
            self.visit(repeated[0], repeat * repeated[1])
        elif op == "cat":
            tensors = arg(node, 0, "tensors")
            if _axis(arg(node, 1, "dim", 0)) not in _MOVABLE:
                raise _Refused
            for t in tensors:
                self.visit(t, repeat)
        elif op in WHOLE_COPIES or (op == "cast" and value.dtype == self.dtype
                                     and example_value(node.args[0]).dtype == self.dtype):
            self.visit(node.args[0], repeat)
        elif op == "getitem" and whole_vector_slices(node.args[1]):
            self.visit(node.args[0], repeat)
        else:
            self._leaf(node, repeat)

    def _past(self, node: Node, repeat: int) -> None:
        self._check(example_value(node), repeat)
        self.past[(node.name, repeat)] = None
        for writer in self._writes(node):
            if self.order[writer] > self.order[self.attention]:
                raise _Refused            # written after the attention read it
            if writer.op != "call_method" or writer.target != "index_copy_" or \
                    writer.args[0] is not node:
                raise _Refused
            if _axis(arg(writer, 1, "dim")) not in _MOVABLE:
                raise _Refused
            self._leaf(arg(writer, 3, "source"), repeat)

    def _writes(self, node: Node) -> list[Node]:
        """In-place ops on ``node`` or on any view of it."""
        found, stack = [], [node]
        while stack:
            current = stack.pop()
            for user in current.users:
                if _is_inplace(user):
                    found.append(user)
                elif op_of(user) in _VIEWS:
                    stack.append(user)
        return found


def repeated_kv_heads(node: Node) -> Optional[tuple[Node, int]]:
    """``(x, r)`` when ``node`` is GQA's ``repeat_kv``: ``x[:, :, None]`` (or
    ``x.unsqueeze(2)``) expanded to ``(B, H, r, L, d)`` and reshaped to ``(B, H·r, L, d)``."""
    if op_of(node) not in ("reshape", "view") or not isinstance(node.args[0], Node):
        return None
    expand = node.args[0]
    if op_of(expand) != "expand" or not isinstance(expand.args[0], Node):
        return None
    inserted = expand.args[0]
    if op_of(inserted) == "getitem":
        ok = inserted.args[1] == (slice(None), slice(None), None, slice(None), slice(None))
    else:
        ok = op_of(inserted) == "unsqueeze" and _axis(arg(inserted, 1, "dim"), 5) == 2
    source = inserted.args[0]
    x, out = example_value(source), example_value(node)
    wide = example_value(expand)
    if not ok or not isinstance(x, torch.Tensor) or x.dim() != 4 or wide.dim() != 5 or \
            out.dim() != 4 or tuple(wide.shape) != (*x.shape[:2], wide.shape[2], *x.shape[2:]) \
            or tuple(out.shape) != (x.shape[0], x.shape[1] * wide.shape[2], *x.shape[2:]):
        return None
    return source, int(wide.shape[2])


def key_sources(key: Node, attention: Node, kinds: ValueKinds) -> Optional[KeySources]:
    """The past/fresh decomposition of ``key`` (``(B, H_kv, L, d_h)``) read by ``attention``,
    or None when one cannot be proved (see the module docstring)."""
    value = example_value(key)
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return None
    walk = _Walk(attention, kinds, tuple(value.shape), value.dtype)
    try:
        walk.visit(key)
    except _Refused:
        return None
    if not walk.past:
        return None
    return KeySources(tuple(walk.past), tuple(walk.fresh))
