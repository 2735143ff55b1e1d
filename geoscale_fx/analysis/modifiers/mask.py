"""Masks: additive, boolean (``masked_fill``, ``where``), multiplicative 0/1 and floors on
the scores, and an SDPA's ``attn_mask`` / ``is_causal``.

A mask is applied after the quantization (the quantized tensor is ``s·Q Kᵀ`` before it) and
never widens its range, so it leaves the bound as is — unless a capping modifier follows
(a softcap: ``c·tanh((S + M)/c)`` sees the unbounded ``S + M``), which the bound then
comes from alone: ``inf`` here, ``c`` after the cap. The FP8 q/k/v kernel takes a mask.

Recognised ops, and the operands the scores may come through (the rest is mask):

* ``add(a, b)``: either (a term computed from parameters is a position bias,
  ``position_bias``, which takes it first); ``sub(S, m)``: ``S``;
* ``masked_fill(S, m, v)``: ``S``; ``where(m, a, b)``: ``a`` or ``b``;
* ``max(S, floor)`` with a float or constant floor (XGLM's ``max(S + M, finfo.min)``);
* ``mul(S, b)`` with ``b`` a tensor no input flows into (GPT-1's 0/1 causal buffer) and no
  scalar factor (which is the softmax scale).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import ValueKinds, arg, op_of, scalar_constant, static_bool
from geoscale_fx.analysis.modifiers.draft import ModifierDraft, Route
from geoscale_fx.sites.terms import Modifier

__all__ = ["Mask", "recognize", "in_product"]

#: op -> the arguments the scores may come through
_THROUGH = {"add": slice(0, 2), "sub": slice(0, 1), "masked_fill": slice(0, 1),
            "where": slice(1, 3)}


@dataclass(frozen=True)
class Mask(Modifier):
    """A mask on the scores, applied after their quantization."""
    kind: ClassVar[str] = "mask"
    fp8_qkv: ClassVar[bool] = True

    def transform(self, bound, later, resolve):
        """``bound`` itself; ``inf`` when a capping modifier follows (it bounds alone)."""
        if any(m.caps for m in later):
            return torch.full_like(bound, float("inf"))
        return bound


def recognize(node: Node, kinds: ValueKinds) -> Optional[tuple[Route, ...]]:
    """The routes through a mask op (the module docstring), or None."""
    op = op_of(node)
    if op in _THROUGH:
        operands = node.args[_THROUGH[op]]
    elif op in ("max", "maximum") and len(node.args) == 2 and \
            _not_activation(node.args[1], kinds):
        operands = node.args[:1]
    elif op == "mul":
        operands = _multiplied(node, kinds)
        if not operands:
            return None
    else:
        return None
    draft = ModifierDraft(Mask, node)
    return tuple(Route(x, draft, masks=True, names_blocker=True) for x in operands)


def in_product(node: Node, kinds: ValueKinds) -> Optional[Route]:
    """An SDPA's own mask (``attn_mask``, or ``is_causal``)."""
    if op_of(node) != "sdpa":
        return None
    mask = arg(node, 3, "attn_mask")
    if mask is None and not static_bool(arg(node, 5, "is_causal", False)):
        return None
    return Route(node, ModifierDraft(Mask, node), masks=mask is not None)


def _multiplied(node: Node, kinds: ValueKinds) -> tuple:
    """``S · b``: ``(S,)`` when ``b`` is a tensor no input flows into and no factor is a
    nonzero scalar (a scalar factor is the softmax scale); ``()`` otherwise."""
    a, b = node.args[0], node.args[1]
    if any(scalar_constant(c) not in (None, 0) for c in (a, b)):
        return ()
    return next(((x,) for x, c in ((a, b), (b, a))
                 if isinstance(c, Node) and not kinds.is_activation(c)), ())


def _not_activation(value, kinds: ValueKinds) -> bool:
    """A float, or a tensor that no input of the model flows into (a constant floor; an int
    would be ``torch.max(S, dim)``, a reduction)."""
    return isinstance(value, float) or (isinstance(value, Node) and
                                        not kinds.is_activation(value))
