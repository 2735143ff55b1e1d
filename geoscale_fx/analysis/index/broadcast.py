"""Broadcast-compact operations on index trackers.

A tracker is usually constant along many dimensions (feature indices do not depend on the
token, token indices not on the feature), which an expanded tensor stores with stride 0. Torch
materializes such tensors in elementwise ops, ``cat`` and merging reshapes; these versions keep
the broadcast dimensions at size 1 and expand back, so tracking costs O(heads × d_h), not
O(batch × sequence × features).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

__all__ = ["compact", "elementwise", "concat", "reshape", "all_equal", "take_last"]


def compact(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with every broadcast (stride-0) dimension narrowed to size 1."""
    index = tuple(slice(0, 1) if st == 0 and size > 1 else slice(None)
                  for size, st in zip(t.shape, t.stride()))
    return t[index]


def elementwise(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` applied on compacted inputs, expanded to the full broadcast shape."""
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return fn(*(compact(t) for t in tensors)).expand(shape)


def take_last(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[..., index]`` on the compacted tensor (broadcast in every other dimension)."""
    c = compact(t)
    return c.expand(*c.shape[:-1], t.shape[-1]).index_select(-1, index)


def all_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``(a == b).all()`` without materializing broadcast dimensions."""
    return bool((compact(a) == compact(b)).all())


def concat(tensors: Sequence[torch.Tensor], dim: int, stack: bool = False) -> torch.Tensor:
    """``torch.cat`` (or ``torch.stack``) that keeps dimensions broadcast in every input."""
    if stack:
        dim = dim if dim >= 0 else dim + tensors[0].dim() + 1
        tensors = [t.unsqueeze(dim) for t in tensors]
    ndim = tensors[0].dim()
    dim = dim if dim >= 0 else dim + ndim
    out_shape = list(tensors[0].shape)
    out_shape[dim] = sum(t.shape[dim] for t in tensors)
    parts = [compact(t) for t in tensors]
    sizes = [1 if all(p.shape[d] == 1 for p in parts) else tensors[0].shape[d]
             for d in range(ndim)]
    grown = []
    for t, p in zip(tensors, parts):
        target = list(sizes)
        target[dim] = t.shape[dim]
        grown.append(p.expand(target))
    return torch.cat(grown, dim).expand(out_shape)


def _groups(a: Sequence[int], b: Sequence[int]):
    """Partition two shapes of equal numel into runs of consecutive dims with equal products."""
    if 0 in a or 0 in b:
        return None
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                return None
        groups.append((gi, gj))
    if not groups:
        return None
    groups[-1][0].extend(range(i, len(a)))   # trailing size-1 dims
    groups[-1][1].extend(range(j, len(b)))
    return groups


def reshape(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t.reshape(shape)`` that keeps whole broadcast dimension groups broadcast."""
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = t.numel() // known if known else 0
    try:
        return t.view(shape)
    except RuntimeError:
        pass
    groups = _groups(tuple(t.shape), shape)
    if groups is None:
        return t.reshape(shape)
    c = compact(t)
    grow = list(c.shape)
    target = []
    for in_dims, out_dims in groups:
        if all(c.shape[i] == 1 for i in in_dims):
            target += [1] * len(out_dims)
        else:
            for i in in_dims:
                grow[i] = t.shape[i]
            target += [shape[o] for o in out_dims]
    return c.expand(grow).reshape(target).expand(shape)
