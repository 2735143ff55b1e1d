"""The registered score modifiers (``MODIFIERS``) and the walk's questions to them.

``MODIFIERS`` maps each kind to its module, which holds

* ``recognize(node, kinds) -> tuple[Route, ...] | None`` — the routes through an op between
  ``Q Kᵀ`` and the softmax that the kind recognises (None: not its op; ``()``: its op, through
  which no scores come);
* ``in_product(node, kinds) -> Route | None`` — what the op computing ``Q Kᵀ`` adds to it
  (baddbmm's β·bias, an SDPA's mask);
* the ``sites.terms.Modifier`` subclass its drafts become: ``transform`` (the bound),
  ``fp8_qkv`` (whether the FP8 q/k/v kernel takes it), ``caps``.

The order is the order of precedence: when two kinds recognise an op through the same
operand, the first listed is what the op is (a position bias before a mask).

Example::

    routes = routes_through(node, kinds)      # None: no kind recognises the op
"""
from __future__ import annotations

from typing import Optional

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from geoscale_fx.analysis.modifiers import mask, position_bias, sink, softcap
from geoscale_fx.analysis.modifiers.draft import Route

__all__ = ["MODIFIERS", "routes_through", "product_routes"]

#: kind -> its module; a new score modifier is one module and one entry here
#: (docs/extending.md)
MODIFIERS = {
    "softcap": softcap,
    "position_bias": position_bias,
    "mask": mask,
    "sink": sink,
}


def routes_through(node: Node, kinds: ValueKinds) -> Optional[list[Route]]:
    """The routes through ``node`` of every kind that recognises it, in the order of the
    op's arguments (per operand, the first kind listed); None when no kind recognises it."""
    answers = [module.recognize(node, kinds) for module in MODIFIERS.values()]
    if all(a is None for a in answers):
        return None
    routes: list[Route] = []
    for route in (r for a in answers if a is not None for r in a):
        if not any(route.operand is taken.operand for taken in routes):
            routes.append(route)
    return sorted(routes, key=lambda r: _position(node, r.operand))


def product_routes(node: Node, kinds: ValueKinds) -> list[Route]:
    """What the registered kinds find in the op computing ``Q Kᵀ`` itself."""
    found = (module.in_product(node, kinds) for module in MODIFIERS.values())
    return [route for route in found if route is not None]


def _position(node: Node, operand) -> int:
    """Where ``operand`` stands in the op's arguments (one not among them: last)."""
    return next((i for i, a in enumerate(node.args) if a is operand), len(node.args))
