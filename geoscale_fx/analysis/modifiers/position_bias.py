"""Position biases: a term computed from parameters added to the scores (ALiBi through
``baddbmm``'s β·bias, MPNet's bucketed relative bias, DeBERTa's content-to-position and
position-to-content terms).

Added after the quantization as a mask is (the same bound transform: ``mask.Mask``); a
report names it (``api.reporting``: added in high precision). The FP8 q/k/v kernel takes
no bias.

Recognised ops:

* ``add(a, b)`` where the operand the scores do not come through reads a parameter (an
  add of anything else is a mask: registered before ``mask``, this kind takes such an
  operand first);
* ``baddbmm(bias, q, kᵀ, β, α) = β·bias + α·q kᵀ``, the product itself (``in_product``):
  ``α`` is a factor of the scale, ``β`` the draft's value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import ValueKinds, baddbmm_args, op_of, upstream
from geoscale_fx.analysis.modifiers.draft import ModifierDraft, Route
from geoscale_fx.analysis.modifiers.mask import Mask

__all__ = ["PositionBias", "recognize", "in_product", "reads_parameters"]


@dataclass(frozen=True)
class PositionBias(Mask):
    """A learned term added to the scores after their quantization (``value``: β)."""
    kind: ClassVar[str] = "position_bias"
    fp8_qkv: ClassVar[bool] = False


def recognize(node: Node, kinds: ValueKinds) -> Optional[tuple[Route, ...]]:
    """``add(a, b)``: a route through each operand whose other one reads parameters."""
    if op_of(node) != "add":
        return None
    a, b = node.args[:2]
    draft = ModifierDraft(PositionBias, node, 1.0)
    routes = tuple(Route(x, draft, masks=True, names_blocker=True)
                   for x, added in ((a, b), (b, a))
                   if added is not x and reads_parameters(added, kinds))
    return routes or None


def in_product(node: Node, kinds: ValueKinds) -> Optional[Route]:
    """``baddbmm``'s ``β·bias``, added to ``α·q kᵀ``."""
    if op_of(node) != "baddbmm":
        return None
    _, _, _, beta, alpha = baddbmm_args(node)
    return Route(node, ModifierDraft(PositionBias, node, beta), factor=alpha, masks=True)


def reads_parameters(node, kinds: ValueKinds, depth: int = 24) -> bool:
    """Whether a term added to the scores is computed from parameters (a learned position
    bias), not only from the inputs and constants (an attention mask)."""
    return isinstance(node, Node) and any(
        n.op in ("placeholder", "get_attr") and kinds.is_param(n)
        for n in upstream([node], depth=depth))
