"""Which key head each query head reads (GQA), and which query head each score slice holds.

``pair_heads`` reads the head of every row of the query and key operands (``HeadRows``,
broadcast over batch and heads as the attention does; ``enable_gqa`` repeats key heads) and
requires the grouping ``query head h → key head h // g``; a grouping that differs between
batch entries, or is not contiguous, is refused naming the attention node.
``score_head_period`` gives the scores' head layout the rewrite indexes by.

Example::

    period, lead = score_head_period(torch.arange(4).repeat(2, 1))   # (batch 2, heads 4)
    assert (period, lead) == ((0, 1, 2, 3), ())
"""
from __future__ import annotations

import math

import torch

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.provenance import HeadRows

__all__ = ["pair_heads", "score_head_period"]


def pair_heads(cand: Candidate, q: HeadRows, k: HeadRows) -> tuple[list[int], tuple]:
    """Key head of every query head; reorders key heads so that query head h reads h // g."""
    q_map, k_map = q.head_of_row, k.head_of_row
    if cand.gqa:
        if q_map.dim() < 1 or k_map.dim() < 1 or q_map.shape[-1] % k_map.shape[-1]:
            raise Unsupported(f"`{cand.node.name}`: enable_gqa with incompatible head counts")
        k_map = k_map.repeat_interleave(q_map.shape[-1] // k_map.shape[-1], dim=-1)
    try:
        lead = torch.broadcast_shapes(q_map.shape, k_map.shape)
    except RuntimeError:
        raise Unsupported(f"`{cand.node.name}`: query and key batch/head shapes "
                          f"{tuple(q_map.shape)} and {tuple(k_map.shape)} do not broadcast")
    pairs = torch.stack([q_map.expand(lead).reshape(-1), k_map.expand(lead).reshape(-1)], 1)
    kv_of_q: dict[int, int] = {}
    for qh, kh in pairs.tolist():
        if kv_of_q.setdefault(qh, kh) != kh:
            raise Unsupported(f"`{cand.node.name}`: query head {qh} reads different key heads "
                              "in different batch entries")
    n_q = len(q.features)
    order: dict[int, int] = {}
    for h in range(n_q):
        order.setdefault(kv_of_q[h], len(order))
    n_kv = len(order)
    mapping = [order[kv_of_q[h]] for h in range(n_q)]
    if n_q % n_kv or mapping != [h // (n_q // n_kv) for h in range(n_q)]:
        raise Unsupported(f"`{cand.node.name}`: query heads share key heads in a "
                          f"non-contiguous grouping {mapping}")
    k_features = tuple(k.features[kh] for kh in sorted(order, key=order.__getitem__))
    return mapping, k_features


def score_head_period(head_of_row: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(period, fixed_lead)``: the query head of each leading score slice.

    The head of flattened leading index ``i`` is ``period[i % len(period)]``; the dims
    outside the period hold batch entries, so any batch size fits. When heads vary along the
    outermost leading dim (heads outside the batch, an unusual layout) no such period exists:
    the whole lead is returned as ``fixed_lead`` and the rewrite specializes on it.
    """
    flat = head_of_row.reshape(-1).tolist()
    lead = list(head_of_row.shape)
    while len(lead) > 1 and lead[0] == 1:
        lead.pop(0)
    inner = math.prod(lead[1:]) if len(lead) > 1 else len(flat)
    for period in range(1, inner + 1):
        if inner % period == 0 and flat == flat[:period] * (len(flat) // period):
            return tuple(flat[:period]), ()
    return tuple(flat), tuple(head_of_row.shape)

