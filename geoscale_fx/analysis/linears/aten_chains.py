"""Reading ATen graphs of low-precision linears: views, exact upcasts, and the cast of an
operand with scales from its own values.

``dynamic_cast(node, source)`` recognizes, on the ATen graph of an FP8 linear, the cast of
``source`` whose output is ``node``::

    bits = _to_copy(clamp(v ⊙ s, −C, C), dtype=fp8)          (the clamp optional)
    v    = source (through views and exact upcasts)
    s    = [exp2(floor(log2(·)))] ∘ _to_copy(f32) ∘ (R · reciprocal(clamp(a, min=ε)))
    a    = _to_copy(f64)( max|v| )  or  amax(|v|, dims, keepdim=True)

i.e. per group (the whole tensor, or the entries ``amax`` reduces over) ``s_g =
R / max(amax_g, ε)``, in float32, optionally rounded down to a power of two. It returns the
``DynamicCast`` (``amax_g·s_g ≤ R``; ``s_g ≥ R/max(amax_g, ε)``, or half of that when
rounded to a power of two) and the node ``s``, which the dequantization must divide by.
Every step is checked on the graph (the reduction's dims against the broadcast of ``s``);
any other form is None. Example (torchao's rowwise recipe: ``bits`` the ``_to_copy`` of the
input, ``x`` the trace's first placeholder)::

    cast, s = dynamic_cast(bits, x)
    cast.groups, cast.scaled_max, cast.scale_floor       # ('rows', 448.0, 224.0)
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Node

from geoscale_fx.core.rounding import unit_roundoff
from geoscale_fx.sites.linear_casts import DynamicCast

__all__ = ["A", "VIEW_OPS", "is_op", "val", "strip_views", "upcast_source",
           "scalar", "FP8_STORAGE", "dynamic_cast", "downcast_rounding"]

A = torch.ops.aten

#: ops that keep every element and its position in row-major order
VIEW_OPS = frozenset({A.view.default, A._unsafe_view.default, A.reshape.default,
                      A.alias.default, A.clone.default, A.detach.default})

FP8_STORAGE = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def is_op(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def val(node: Any) -> Any:
    """The fake value make_fx recorded for ``node``."""
    return node.meta.get("val") if isinstance(node, Node) else None


def _dtype(node: Node) -> Optional[torch.dtype]:
    value = val(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def strip_views(node: Any) -> Any:
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    return node


def _copy_dtype(node: Node) -> Optional[torch.dtype]:
    """The dtype a plain ``_to_copy`` casts to (None for any other node or copy)."""
    if not is_op(node, A._to_copy.default) or set(node.kwargs) - {"dtype"}:
        return None
    return node.kwargs.get("dtype")


def upcast_source(node: Any) -> Any:
    """``node`` behind views and casts that keep every value (to a wider float)."""
    while True:
        node = strip_views(node)
        target = _copy_dtype(node) if isinstance(node, Node) else None
        source = node.args[0] if target is not None else None
        if target is None or not isinstance(source, Node) or _dtype(source) is None or \
                not _dtype(source).is_floating_point or not target.is_floating_point or \
                torch.finfo(target).bits < torch.finfo(_dtype(source)).bits or \
                torch.finfo(target).eps > torch.finfo(_dtype(source)).eps:
            return node
        node = source


def scalar(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def downcast_rounding(source: torch.dtype, target: torch.dtype) -> float:
    """The relative rounding of a cast from ``source`` to ``target``: 0 when ``target`` holds
    every value of ``source``, else ``target``'s unit roundoff."""
    if torch.finfo(target).eps <= torch.finfo(source).eps:
        return 0.0
    return unit_roundoff(target)


def _scaled_product(node: Node, source: Node) -> Optional[tuple[Node, Node]]:
    """``(operand, scale)`` of ``mul(v, s)`` with ``v`` (through upcasts) ``source``."""
    if not is_op(node, A.mul.Tensor):
        return None
    for v, s in (node.args, node.args[::-1]):
        if isinstance(v, Node) and isinstance(s, Node) and upcast_source(v) is source:
            return v, s
    return None


def _exact_source(node: Any) -> Any:
    """``node`` behind casts that keep every value, views not passed (positions matter)."""
    while isinstance(node, Node) and _copy_dtype(node) is not None and \
            upcast_source(node) is not node and strip_views(node.args[0]) is node.args[0]:
        node = node.args[0]
    return node


def _amax_groups(amax: Node, operand: Node, scale: Node) -> Optional[str]:
    """The groups of ``amax`` = max|v| (``"tensor"``, ``"rows"`` …) when it reduces the very
    tensor ``scale`` multiplies (``operand``, up to exact upcasts: same positions) over the
    dims ``scale`` is broadcast along; None otherwise."""
    if not is_op(amax, A.max.default, A.amax.default) or not is_op(amax.args[0], A.abs.default):
        return None
    if _exact_source(amax.args[0].args[0]) is not _exact_source(operand):
        return None
    shape, s_shape = tuple(val(operand).shape), tuple(val(scale).shape)
    if is_op(amax, A.max.default):
        return "tensor" if val(scale).numel() == 1 else None
    dims = amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("dim", [])
    keep = amax.args[2] if len(amax.args) > 2 else amax.kwargs.get("keepdim", False)
    if not keep or len(s_shape) != len(shape) or tuple(val(amax).shape) != s_shape:
        return None
    reduced = {d % len(shape) for d in dims}
    for i, (n, m) in enumerate(zip(shape, s_shape)):
        if m != (1 if i in reduced else n):      # one scale per group, one group per scale
            return None
    return "rows" if reduced == {len(shape) - 1} else f"groups over dims {sorted(reduced)}"


def _scale_rule(scale: Node) -> Optional[tuple[Node, float, float, bool]]:
    """``(amax node, R, ε, pow2)`` of ``s = [pow2] f32(R · reciprocal(clamp(f64(amax), ε)))``."""
    pow2 = is_op(scale, A.exp2.default) and is_op(scale.args[0], A.floor.default) and \
        is_op(scale.args[0].args[0], A.log2.default)
    node = scale.args[0].args[0].args[0] if pow2 else scale
    if _copy_dtype(node) in (torch.float32, torch.float64):
        node = node.args[0]
    if not is_op(node, A.mul.Tensor):
        return None
    a, b = node.args
    recip, target = (a, scalar(b)) if isinstance(a, Node) else (b, scalar(a))
    if target is None or target <= 0 or not is_op(recip, A.reciprocal.default):
        return None
    clamp = recip.args[0]
    eps = None
    if is_op(clamp, A.clamp.default) and len(clamp.args) >= 2 and \
            (len(clamp.args) < 3 or clamp.args[2] is None):
        eps = scalar(clamp.args[1])
    elif is_op(clamp, A.clamp_min.default):
        eps = scalar(clamp.args[1])
    if eps is None or eps <= 0:
        return None
    amax = clamp.args[0]
    if _copy_dtype(amax) in (torch.float32, torch.float64):
        amax = amax.args[0]
    return amax, target, eps, pow2


def dynamic_cast(node: Any, source: Node) -> Optional[tuple[DynamicCast, Node]]:
    """``(DynamicCast, s)`` when ``node`` is the FP8 cast of ``source`` with scales from its
    own values (module docstring); None otherwise."""
    dtype = _copy_dtype(node) if isinstance(node, Node) else None
    if dtype not in FP8_STORAGE:
        return None
    inner = node.args[0]
    fmt_max = float(torch.finfo(dtype).max)
    clip = fmt_max
    if is_op(inner, A.clamp.default) and len(inner.args) == 3:
        low, high = scalar(inner.args[1]), scalar(inner.args[2])
        if low is None or high is None or low != -high or high <= 0:
            return None
        clip, inner = min(high, fmt_max), inner.args[0]
    found = _scaled_product(inner, source)
    if found is None:
        return None
    operand, scale = found
    rule = _scale_rule(scale)
    if rule is None:
        return None
    amax, target, eps, pow2 = rule
    groups = _amax_groups(amax, operand, scale)
    if groups is None:
        return None
    cast = DynamicCast(str(dtype).removeprefix("torch."), clip=clip, scaled_max=target,
                       scale_floor=target / 2.0 if pow2 else target, eps=eps, groups=groups)
    return cast, scale
