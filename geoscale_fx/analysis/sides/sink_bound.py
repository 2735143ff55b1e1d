"""A data-dependent attention sink: the side that bounds its logits, or why there is none.

A sink joined to the scores (``cat([S, sink], -1)``, ``find_sites``) is a learned parameter
(gpt-oss) or computed from the activations (Inkling-2: ``sink_proj(x)``, one logit per query
and head). For the second, the softmax receives ``sink_f = w_fᵀ x + b_f`` for some output
feature ``f`` of a projection of ``x = g ⊙ x̂ + β`` with ``‖x̂‖ ≤ ρ`` (a normalized or
value-bounded source, ``operand_sides.input_source``), so

    |sink_f| ≤ ρ·‖g ⊙ w_f‖ + |w_fᵀβ + b_f|          (Cauchy–Schwarz)

which is a ``Side`` with one "head" of width 1 per output feature: ``‖A_f‖₂ = ‖g ⊙ w_f‖``,
``c_f = w_fᵀβ + b_f`` (``analysis.modifiers.sink`` bounds the maximum over ``f``, so
every feature that can reach the sink column is covered whatever the views between). A sink
that is not such a projection is refused naming its node.
"""
from __future__ import annotations

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import DATA_MOVEMENT, VALUE_CASTS, ValueKinds, op_of, shape_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.operand_sides import input_source
from geoscale_fx.analysis.sides.provenance import parameter_names, projection_at
from geoscale_fx.sites.terms import Side

__all__ = ["sink_side"]


def sink_side(sink: Node, kinds: ValueKinds) -> Side:
    """The ``Side`` whose per-feature bound covers every value of the sink logits ``sink``."""
    node = sink
    for _ in range(16):
        projection = projection_at(node, kinds)
        if projection is not None:
            break
        if (op_of(node) not in DATA_MOVEMENT and op_of(node) not in VALUE_CASTS) or \
                not isinstance(node.args[0], Node) or op_of(node) in ("cat", "stack"):
            raise Unsupported(f"the sink logits `{sink.name}` are computed from the "
                              f"activations, and `{node.name}` ({op_of(node) or node.op}) "
                              "is not a projection of a normalized input: their size is "
                              "not bounded")
        node = node.args[0]
    else:
        raise Unsupported(f"the sink logits `{sink.name}`: no projection within 16 views")
    try:
        source = input_source(projection.x, kinds, projection.root)
    except Unsupported as exc:
        raise Unsupported(f"the sink logits `{sink.name}` are a projection of an unbounded "
                          f"input: {exc}") from None
    width = (shape_of(projection.root) or (0,))[-1]
    weight_param, bias_param = parameter_names(projection)
    return Side(source=source, weight=projection.weight.name, layout=projection.layout,
                features=tuple((f,) for f in range(width)),
                bias=projection.bias.name if projection.bias is not None else None,
                weight_param=weight_param, bias_param=bias_param,
                inner=projection.inner.name if projection.inner is not None else None,
                cast=projection.cast)
