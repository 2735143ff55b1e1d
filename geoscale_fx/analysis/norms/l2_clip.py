"""The L2 clip: ``h · min(m, t / (‖h‖₂ + ε))`` bounds its output, ``‖·‖ ≤ t``, whatever ``h`` is;
so does the scaled L2 normalization ``h · t / max(‖h‖₂, ε)`` (ZAYA's QK-norm).

Inkling-2 clips q and k per head this way (after a learned per-channel gain and, for k, a
short convolution): the clip is a normalization like a QK-norm, the operand's head vector
has norm at most ``t`` (``normalization.trace_normalized_input`` returns it as a source of
kind ``"l2clip"``, radius ``t``), and nothing before it needs to be understood.
"""
from __future__ import annotations

from typing import Optional

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import (
    ValueKinds, arg, is_last_dim, op_of, same_value, scalar_constant, shape_of, strip_casts,
)

__all__ = ["l2_clip"]


def l2_clip(node: Node, kinds: ValueKinds) -> Optional[tuple[Node, float, Node]]:
    """``(h, t, x)`` if ``node`` is ``h · c`` with ``c = min(m, t/(‖h‖₂ + ε))`` over the last
    dim (``clamp(max=m)``, ``clamp_max``, ``minimum``/``min`` with a constant; the cap is
    optional, and ``+ ε`` may be a floor ``max(‖h‖₂, ε)``), else None.

    Then ``‖node‖ = ‖h‖·c ≤ t·‖h‖/(‖h‖+ε) ≤ t`` for any ``h`` (``t > 0``, ``ε ≥ 0``,
    ``0 ≤ m``; a lower clamp ``≤ 0`` is inert since the ratio is positive). ``x`` is ``h``
    before a gain applied ahead of the norm (``h = x ⊙ g``, g a parameter or constant that
    does not broadcast ``x`` up): ``node``'s elements map 1:1 to ``x``'s.
    """
    if op_of(node) != "mul":
        return None
    for h, factor in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (isinstance(h, Node) and isinstance(factor, Node)):
            continue
        factor = strip_casts(factor)
        ratio = _capped(factor)
        found = _threshold_over_norm(ratio if ratio is not None else factor)
        if found is not None and same_value(strip_casts(found[0]), strip_casts(h)):
            return h, found[1], _before_gain(strip_casts(h), kinds)
    return None


def _capped(node: Node) -> Optional[Node]:
    """``v`` if ``node`` is ``min(v, m)`` with a constant ``m ≥ 0`` (and no positive floor)."""
    op = op_of(node)
    if op == "clamp":
        low, high = arg(node, 1, "min"), arg(node, 2, "max")
        floor = scalar_constant(low) if low is not None else 0.0
        high = scalar_constant(high) if high is not None else None
        if high is not None and high >= 0 and floor is not None and floor <= 0:
            return node.args[0]
        return None
    if op in ("clamp_max", "minimum", "min") and len(node.args) == 2:
        for v, m in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if op == "min" and isinstance(m, int):      # torch.min(x, dim): a reduction
                continue
            if isinstance(v, Node) and scalar_constant(m) is not None and \
                    scalar_constant(m) >= 0:
                return v
    return None


def _threshold_over_norm(node: Node) -> Optional[tuple[Node, float]]:
    """``(h, t)`` if ``node`` is ``t / (‖h‖₂ + ε)`` or ``t / max(‖h‖₂, ε)`` (last dim, keepdim;
    ``t > 0``, ``ε ≥ 0``)."""
    node = strip_casts(node)
    if op_of(node) != "div":
        return None
    t = scalar_constant(node.args[0])
    if t is None or t <= 0 or not isinstance(node.args[1], Node):
        return None
    den = strip_casts(node.args[1])
    floored = _floored(den)
    if floored is not None:
        den = floored
    h = _l2_norm_source(den)
    return (h, t) if h is not None else None


def _floored(den: Node) -> Optional[Node]:
    """``n`` if ``den`` is ``n + ε`` or ``max(n, ε)`` with a constant ``ε ≥ 0`` (``clamp_min``,
    ``clamp(min=ε)``, ``maximum``/``max``): either way ``den ≥ n``, so ``t·n/den ≤ t``."""
    op = op_of(den)
    if op == "clamp" and arg(den, 2, "max") is None:
        pairs = ((den.args[0], arg(den, 1, "min")),)
    elif op in ("add", "clamp_min", "maximum", "max") and len(den.args) == 2:
        pairs = ((den.args[0], den.args[1]), (den.args[1], den.args[0]))
    else:
        return None
    for n, eps in pairs:
        if op == "max" and isinstance(eps, int):      # torch.max(x, dim): a reduction
            continue
        value = scalar_constant(eps)
        if isinstance(n, Node) and value is not None and value >= 0:
            return strip_casts(n)
    return None


def _l2_norm_source(node: Node) -> Optional[Node]:
    """``h`` if ``node`` is ``‖h‖₂`` over the last dim with ``keepdim=True``."""
    op = op_of(node)
    if op == "vector_norm":
        order, dim, keep = arg(node, 1, "ord", 2), arg(node, 2, "dim"), arg(node, 3, "keepdim")
    elif op == "norm":
        order, dim, keep = arg(node, 1, "p", "fro"), arg(node, 2, "dim"), arg(node, 3, "keepdim")
    else:
        return None
    h = node.args[0]
    ndim = len(shape_of(h) or ()) if isinstance(h, Node) else 0
    if order not in (2, 2.0, "fro") or not keep or dim is None or not is_last_dim(dim, ndim):
        return None
    return h


def _before_gain(h: Node, kinds: ValueKinds) -> Node:
    """``x`` behind ``h = x ⊙ g`` (g a parameter or constant not broadcasting ``x`` up),
    through casts; ``h`` itself otherwise."""
    for _ in range(8):
        if op_of(h) not in ("mul", "div"):
            return h
        a, b = h.args[0], h.args[1]
        pairs = ((a, b), (b, a)) if op_of(h) == "mul" else ((a, b),)
        for x, g in pairs:
            constant = scalar_constant(g) is not None or (isinstance(g, Node) and
                                                          not kinds.is_activation(g))
            if isinstance(x, Node) and kinds.is_activation(x) and constant and \
                    shape_of(x) == shape_of(h):
                h = strip_casts(x)
                break
        else:
            return h
    return h
