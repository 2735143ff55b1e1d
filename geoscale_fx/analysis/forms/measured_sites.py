"""Sites the weights cannot bound, bounded by their operands' measured norms at every call.

When the query or the key cannot be traced to a bounded source — a graph input from before
a graph break (X-MOD's language adapter), queries from a mixture of attention experts, a
projection the walk does not know — the logits are still bounded, exactly, by the operands
the product reads::

    |S_ij| = s·|q_h,i · k_g(h),j| ≤ s · max_i ‖q_h,i‖ · max_j ‖k_g(h),j‖

Both maxima are measured in the graph, from the very tensors the attention reads (after any
rotation, norm or gain), before it runs: O((L + L')·d) per call, no logits materialized, so
the fused kernels still apply. The bound is certified for that call, whatever produced q
and k; it is not predicted from the weights (no static scale can be exported for it, and a
scale serving engines should read from a checkpoint cannot come from it).

:func:`measured_fields` builds the ``AttentionSite`` fields of that form: one term whose two
sides are *observed* (``Side.layout == "observed"``, ``Source.norm == "measured"``), the
query's head ``h`` paired with key head ``h // (n_q / n_kv)``. It needs the operands laid
out ``(batch, heads, positions, d_h)`` (any permutation an einsum names); otherwise it raises
``Unsupported`` with the weights' reason and its own.
"""
from __future__ import annotations

import torch

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.dtensor import dtensor_of
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, shape_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.forms.site_fields import site_fields
from geoscale_fx.sites.terms import Side, Source, Term

__all__ = ["measured_fields"]


def measured_fields(cand: Candidate, kinds: ValueKinds, why: Unsupported) -> dict:
    """``AttentionSite`` fields bounding ``cand`` by its operands' measured norms (see the
    module); ``Unsupported`` (with ``why`` and the layout found) when they cannot be
    measured per head."""
    if dtensor_of(cand.query) is not None or dtensor_of(cand.key) is not None:
        raise Unsupported(f"{why} — and its operands are DTensors (a global view: their "
                          "norms are not measured on the local shards)")
    q_axes, q_shape = _axes(cand, "query", why)
    k_axes, k_shape = _axes(cand, "key", why)
    n_q, n_k = q_shape[q_axes[0]], k_shape[k_axes[0]]
    if n_q % n_k:
        raise Unsupported(f"{why} — and its {n_q} query heads do not group over its {n_k} "
                          "key heads, so measured norms cannot pair them")
    q_side = _measured_side(cand.query.name, n_q, q_axes)
    k_side = _measured_side(cand.key.name, n_k, k_axes)
    lead = [_hint(s) for s in _permuted(q_shape, cand.query_perm)[:-2]]
    head_of_row = torch.arange(n_q).expand(*lead)
    q_len = _hint(_permuted(q_shape, cand.query_perm)[-2])
    k_len = _hint(k_shape[-1] if cand.key_layout == "dk" and cand.key_perm is None else
                  _permuted(k_shape, cand.key_perm)[-2])
    fields = site_fields(cand, [Term(q_side, k_side)], 1.0, q_len, k_len, head_of_row,
                         head_dim=q_shape[q_axes[1]], kinds=kinds)
    return {**fields, "bound_by": "measured", "unbounded_reason": str(why),
            "value_reason": "the weights do not bound this site's q and k (measured instead)"}


def _hint(size) -> int:
    """A size as an int (a symbolic size's example value)."""
    return size if isinstance(size, int) else int(size.node.hint)


def _permuted(shape: tuple, perm) -> tuple:
    return tuple(shape[i] for i in perm) if perm is not None else tuple(shape)


def _axes(cand: Candidate, role: str, why: Unsupported) -> tuple[tuple[int, int], tuple]:
    """``((head axis, channel axis), shape)`` of an operand, in its own layout."""
    node = cand.query if role == "query" else cand.key
    shape = tuple(shape_of(node) or ())
    perm = cand.query_perm if role == "query" else cand.key_perm
    if len(shape) == 4:
        if perm is not None:
            axes = (perm[-3], perm[-1])
        else:
            axes = (1, 2) if role == "key" and cand.key_layout == "dk" else (1, 3)
        if all(isinstance(shape[a], int) for a in axes):
            return axes, shape
    raise Unsupported(f"{why} — and its {role} `{node.name}` (shape {shape}) is not laid out "
                      "(batch, heads, positions, d_h) for its norms to be measured per head")


def _measured_side(name: str, n_heads: int, axes: tuple[int, int]) -> Side:
    return Side(source=Source(norm="measured", node=name, width=1), weight=None,
                layout="observed", features=tuple((h,) for h in range(n_heads)),
                observed_axes=axes)
