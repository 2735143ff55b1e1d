"""The operands of an attention's scores ``Q Kᵀ``: which is the query, which the key, and how
each is laid out.

``matmul``/``bmm`` read ``q @ kᵀ`` (the key transposed: layout ``"dk"``), ``baddbmm``'s
product likewise; an ``einsum`` names its axes, and the query and key must each keep one
axis of their own (positions), share one contracted axis (channels) and any number of batch
axes, the output being ``batch… q_only k_only`` (layout ``"kd"``, with the permutations
``query_perm``/``key_perm`` to ``(batch…, L, D)``).
"""
from __future__ import annotations

from torch.fx import Node

from geoscale_fx.analysis.forms.candidate import CandidateDraft
from geoscale_fx.analysis.fx.graph_ops import matmul_operands, op_of

__all__ = ["set_operands"]


def set_operands(scores: Node, cand: CandidateDraft) -> bool:
    """Name ``cand``'s query and key from the scores product (and their layout: ``"dk"`` for
    ``q @ kᵀ``, ``"kd"`` with the permutations bringing each einsum operand to
    ``(batch…, L, D)``); False for an einsum that is not ``q·kᵀ``."""
    op = op_of(scores)
    if op in ("matmul", "bmm"):
        cand.query, cand.key, cand.key_layout = scores.args[0], scores.args[1], "dk"
        return True
    if op == "baddbmm":
        cand.query, cand.key = matmul_operands(scores)
        cand.key_layout = "dk"
        return True
    equation = scores.args[0].replace(" ", "")
    if "..." in equation or "->" not in equation:
        return False
    inputs, out = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return False
    qi, ki = terms
    contracted = [c for c in qi if c in ki and c not in out]
    q_only = [c for c in qi if c not in ki]
    k_only = [c for c in ki if c not in qi]
    if len(contracted) != 1 or len(q_only) != 1 or len(k_only) != 1:
        return False
    batch = [c for c in qi if c in ki and c in out]
    if out != "".join(batch) + q_only[0] + k_only[0]:
        return False
    c = contracted[0]
    cand.query, cand.key, cand.key_layout = scores.args[1], scores.args[2], "kd"
    cand.query_perm = tuple(qi.index(x) for x in batch + [q_only[0], c])
    cand.key_perm = tuple(ki.index(x) for x in batch + [k_only[0], c])
    return True
