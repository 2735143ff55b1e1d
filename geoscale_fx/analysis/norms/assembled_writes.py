"""Keys assembled by writes: ``buf = x.new_empty(shape)`` then ``buf[..., a:b].copy_(src)``.

MLA implementations build the key from its latent part and its RoPE part this way. When the
writes cover the whole last dim, in order, before anything reads the buffer, the buffer's
elements are exactly the sources' (``provenance.find_projection`` walks on into each).
"""
from __future__ import annotations

from typing import Optional

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import op_of, shape_of

__all__ = ["assembled_writes"]


def assembled_writes(node: Node) -> Optional[list[tuple[int, int, Node, Node]]]:
    """``buf = x.new_empty(shape)`` whose whole last dim is written by
    ``buf[..., a:b].copy_(src)`` before anything reads it: ``(a, b, src, copy node)`` per
    write, in order of ``a``; None for any other node."""
    if not (node.op == "call_method" and node.target == "new_empty"):
        return None
    shape = shape_of(node)
    if not shape:
        return None
    writes, reads = [], []
    for user in node.users:
        span = _last_dim_slice(user, len(shape), shape[-1])
        copies = [u for u in user.users if u.op == "call_method" and u.target == "copy_"
                  and u.args[0] is user] if span is not None else []
        if span is not None and len(copies) == 1 and len(user.users) == 1:
            writes.append((*span, copies[0].args[1], copies[0]))
        else:
            reads.append(user)
    writes.sort(key=lambda w: w[0])
    covered = [(a, b) for a, b, _, _ in writes]
    if not writes or covered[0][0] != 0 or covered[-1][1] != shape[-1] or \
            any(b != a2 for (_, b), (a2, _) in zip(covered, covered[1:])):
        return None
    graph_order = {n: i for i, n in enumerate(node.graph.nodes)}
    last_write = max(graph_order[c] for *_, c in writes)
    if any(graph_order[r] < last_write for r in reads):
        return None
    return writes


def _last_dim_slice(node: Node, ndim: int, width: int) -> Optional[tuple[int, int]]:
    """``(a, b)`` if ``node`` is ``x[..., a:b]`` (every other dim whole)."""
    if op_of(node) != "getitem":
        return None
    index = node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if index and index[0] is Ellipsis:
        index = (slice(None),) * (ndim - len(index) + 1) + index[1:]
    if len(index) != ndim or not all(isinstance(i, slice) for i in index) or \
            any(i != slice(None) for i in index[:-1]):
        return None
    last = index[-1]
    if last.step not in (None, 1) or not all(isinstance(v, (int, type(None)))
                                              for v in (last.start, last.stop)):
        return None
    start, stop, _ = last.indices(width)
    return (start, stop) if stop > start else None
