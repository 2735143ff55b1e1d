"""Softcapping ``c·tanh(S/c)`` (Gemma 2): the softmax input is bounded by ``c``.

``c·tanh(S/c)`` is odd and increasing, so ``|c·tanh(S/c)| ≤ min(|S|, |c|)``: the bound is
clamped at ``|c|``, and an op before the cap (a mask, a position bias) is inside it
(``caps``). What is quantized is the softcap's output (the ``logits`` role); the walk goes
on from the tanh's input ``y = s·QKᵀ/c``, so S's own scale is ``scale(y)·c``, and factors
between the softcap and the softmax do not scale S. The FP8 q/k/v kernel takes no softcap.

Recognised op: ``mul(tanh(y), c)`` (either order, casts between) with ``c`` a nonzero
scalar.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, ValueKinds, op_of, scalar_constant
from geoscale_fx.analysis.modifiers.draft import ModifierDraft, Route
from geoscale_fx.sites.terms import Modifier

__all__ = ["Softcap", "recognize", "in_product"]


@dataclass(frozen=True)
class Softcap(Modifier):
    """``c·tanh(S/c)`` (``value``: ``|c|``)."""
    kind: ClassVar[str] = "softcap"
    caps: ClassVar[bool] = True

    def transform(self, bound, later, resolve):
        """``min(bound, |c|)``."""
        return torch.clamp(bound, max=abs(self.value))


def recognize(node: Node, kinds: ValueKinds) -> Optional[tuple[Route, ...]]:
    """The route through ``c·tanh(y)``: ``y``, with the factor ``c``."""
    if op_of(node) != "mul":
        return None
    for t, c in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        cap = scalar_constant(c)
        while isinstance(t, Node) and op_of(t) in VALUE_CASTS:
            t = t.args[0]
        if cap is not None and cap != 0 and isinstance(t, Node) and op_of(t) == "tanh":
            return (Route(t.args[0], ModifierDraft(Softcap, node, abs(cap)), factor=cap,
                          logits=True),)
    return None


def in_product(node: Node, kinds: ValueKinds) -> Optional[Route]:
    """Never part of the product op."""
    return None
