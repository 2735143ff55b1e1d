"""The pieces of a rotary embedding as replay meets them, before they are proven a rotation.

``x·cos`` and ``rot(x)·sin`` each reach the ``add`` that joins them as a ``RotaryTerm`` (the
track times a table: ``m·cos(E)`` / ``m·sin(E)`` up to views, or a table known only by its
values); the halves form's ``x1·c ∓ x2·s`` is a ``RotaryHalf``; ``view_as_complex(x)``,
possibly times ``z``, a ``ComplexValue``. ``trig_origin`` reads ``(trig, E, m, …)`` off a
table node. ``analysis.rotary.rotary_replay`` combines the pieces; ``analysis.rotary.rotary_gain`` bounds the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, op_of, scalar_constant, shape_of
from geoscale_fx.analysis.index.index_track import Track

__all__ = ["RotaryTerm", "RotaryHalf", "ComplexValue", "TABLE_VIEWS", "trig_origin"]


@dataclass
class RotaryTerm:
    """``track * table``: half of a rotary embedding, waiting for the ``add`` that completes it.

    ``trig`` is "cos"/"sin" when the table is ``m·cos(E)``/``m·sin(E)`` up to views, None
    when it is known only by its values (evaluated from parameters, buffers and constants).
    """
    track: Track
    trig: Optional[str]
    angles: Optional[Node]   # E
    factor: float            # m
    chain: tuple             # the view ops from cos/sin(E) to the table, to compare both
    keeps_last: bool         # every node from E to the table keeps E's last dim
    table: Node
    via: str = ""            # the ``mul`` node


@dataclass
class RotaryHalf:
    """``x1·c ∓ x2·s``: one half of the halves form; ``swapped``'s gain carries the sign."""
    direct: RotaryTerm
    swapped: RotaryTerm


@dataclass
class ComplexValue:
    """``view_as_complex`` of a track (last dim: real, imaginary), possibly times ``z``."""
    track: Track
    factor: float = 0.0              # max |z| once multiplied (0: not multiplied)
    table: Optional[Node] = None


#: views a rotary table may go through between ``cos``/``sin`` (or ``polar``) and its use
TABLE_VIEWS = frozenset({"unsqueeze", "view", "reshape", "getitem", "expand", "squeeze",
                         "transpose", "permute", "flatten"})


def trig_origin(table: Node):
    """``(trig, E, m, chain, keeps_last)`` if ``table`` is ``m·cos(E)`` or ``m·sin(E)`` up to
    views; ``keeps_last``: no node between E and the table changes or moves the last dim."""
    factor, chain, node = 1.0, [], table
    width = (shape_of(table) or (None,))[-1]
    keeps_last = True
    for _ in range(32):
        op = op_of(node)
        keeps_last = keeps_last and (shape_of(node) or (None,))[-1] == width and \
            op not in ("transpose", "permute")
        if op in ("cos", "sin"):
            angles = node.args[0]
            keeps_last = keeps_last and (shape_of(angles) or (None,))[-1] == width
            return op, angles, factor, tuple(reversed(chain)), keeps_last
        if op in VALUE_CASTS:
            node = node.args[0]
        elif op == "mul" and isinstance(node.args[0], Node) and \
                scalar_constant(node.args[1]) is not None:
            factor *= scalar_constant(node.args[1])
            node = node.args[0]
        elif op == "mul" and isinstance(node.args[1], Node) and \
                scalar_constant(node.args[0]) is not None:
            factor *= scalar_constant(node.args[0])
            node = node.args[1]
        elif op in TABLE_VIEWS and isinstance(node.args[0], Node):
            chain.append((op, tuple(a.name if isinstance(a, Node) else a for a in node.args[1:])))
            node = node.args[0]
        else:
            return None
    return None

