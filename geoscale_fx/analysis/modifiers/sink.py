"""Attention sinks: a logit per head joined to the scores, ``cat([S, sink], -1)`` (gpt-oss's
learned parameter; Inkling-2's projection of the input, one logit per query).

The softmax also receives the sink logits, so the bound covers them:
``max(bound, max|sink|)``; for a sink computed from the activations (a projection of a
bounded input, ``analysis.sides.sink_bound``) ``max_f ρ‖A_f‖ + |c_f|`` of its ``Side``.
The FP8 q/k/v kernel takes no sink.

Recognised op: ``cat([S, sink], -1)`` with ``sink`` a parameter (through views) or a width-1
activation; the scores come through ``S``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import (
    DATA_MOVEMENT, VALUE_CASTS, ValueKinds, arg, op_of, shape_of,
)
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.modifiers.draft import ModifierDraft, Route
from geoscale_fx.analysis.sides.sink_bound import sink_side
from geoscale_fx.numerics.head_weights import side_heads_envelope, side_radius
from geoscale_fx.sites.terms import Modifier, Side

__all__ = ["Sink", "SinkDraft", "recognize", "in_product"]


@dataclass(frozen=True)
class Sink(Modifier):
    """Sink logits joined to the scores: a parameter (``param``) or a projection
    (``side``)."""
    kind: ClassVar[str] = "sink"

    def transform(self, bound, later, resolve):
        """``max(bound, max|sink|)``."""
        if self.side is not None:
            return torch.maximum(bound, _projected_sink_bound(self.side, resolve)
                                 .to(device=bound.device, dtype=bound.dtype))
        sink = resolve(self.param).detach().abs().amax().to(bound.dtype)
        return torch.maximum(bound, sink.to(bound.device))


def _projected_sink_bound(side: Side, resolve) -> torch.Tensor:
    """``max_f ρ‖A_f‖ + |c_f|`` (float64): every sink logit ``A_fᵀx̂ + c_f`` with ``‖x̂‖ ≤ ρ``
    (a low-precision projection: ``ρ`` widened and its ball ``R_f`` added,
    ``numerics.cast_envelope``)."""
    a, c, envelope = side_heads_envelope(side, resolve)              # (F, d, 1), (F, 1)
    rho = side_radius(side, resolve)
    if envelope is not None:
        rho = rho * envelope.radius_factor
    bound = rho * torch.linalg.vector_norm(a.detach().double(), dim=(-2, -1))
    if c is not None:
        bound = bound + c.detach().double().abs().reshape(-1)
    if envelope is not None:
        bound = bound + envelope.deviation
    return bound.amax()


@dataclass(frozen=True)
class SinkDraft(ModifierDraft):
    """A sink found by the walk; ``node`` is the sink logits (a placeholder: a parameter)."""

    def site_modifier(self, cand, kinds: Optional[ValueKinds]) -> Sink:
        """A parameter, or a projection of a bounded input (refused naming the attention
        where the form has no graph to bound it from)."""
        if self.node.op == "placeholder":
            return Sink(self.node.name, self.value, param=self.node.name)
        if kinds is None:
            raise Unsupported(f"`{cand.node.name}`: the sink logits `{self.node.name}` are "
                              "computed from the activations, which this attention form "
                              "does not bound")
        return Sink(self.node.name, self.value, side=sink_side(self.node, kinds))


def recognize(node: Node, kinds: ValueKinds) -> Optional[tuple[Route, ...]]:
    """The route through ``cat([S, sink], -1)``: ``S``. A cat of two along another dim, or
    with a constant, is recognised and leads nowhere (``()``); one whose sink is neither a
    parameter nor a width-1 activation is not recognised (the walk names it)."""
    if op_of(node) != "cat":
        return None
    parts, dim = arg(node, 0, "tensors"), arg(node, 1, "dim", 0)
    if dim not in (-1, len(shape_of(node) or ()) - 1) or len(parts) != 2:
        return ()
    scores, sink = parts
    if not isinstance(sink, Node):
        return ()
    if kinds.is_param(sink):
        sink = _value_source(sink)  # the sinks parameter itself (max|·| is unchanged by views)
    elif not (kinds.is_activation(sink) and (shape_of(sink) or (0,))[-1] == 1):
        sink = None
    return None if sink is None else (Route(scores, SinkDraft(Sink, sink)),)


def in_product(node: Node, kinds: ValueKinds) -> Optional[Route]:
    """Never part of the product op."""
    return None


def _value_source(node: Node) -> Optional[Node]:
    """The placeholder behind ``node`` through views and casts only (same values), or None."""
    for _ in range(16):
        if node.op == "placeholder":
            return node
        if op_of(node) not in DATA_MOVEMENT and op_of(node) not in VALUE_CASTS:
            return None
        node = node.args[0] if isinstance(node.args[0], Node) else None
        if node is None:
            return None
    return None
