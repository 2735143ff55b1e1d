"""Inputs bounded by value: ``‖x‖`` per token from parameters and buffers, without a norm.

``trace_value_bound(x, kinds)`` walks from a projection's input back through the ops whose
effect on each token's vector norm is bounded by the values of the model's state, and returns
the expression of that bound (``geoscale_fx.core.parameter_radius``), or None where some op on the way
is not (a graph input such as raw hidden states, a product of two activations, an unknown op).
It is the fallback of ``operand_sides.input_source`` when no normalization precedes the
projection (``normalization.trace_normalized_input`` failed); that function's reason is what
a refused site reports. What the walk accepts, ``r`` a bound on the operand's norm:

* a normalization output with its per-channel ops (``trace_normalized_input`` from here):
  ``radius_factor·√d·max|g| + ‖β‖``;
* a value of parameters/constants only, or a gather of its rows (``F.embedding``,
  ``W[ids]``, ``index_select``): the largest last-dim vector of the whole table;
* sums and differences (triangle inequality), scalar-constant mul/div, negation, dropout
  (``1/(1−p)`` in training), casts and views that keep the feature dimension;
* a product with a parameter (``max|v|·r``) or with a factor in [0, 1] by construction — a
  boolean tensor (a comparison, a logical op, a 0/1 padding mask) cast to a float, a sigmoid
  (``r`` unchanged: ``‖m ⊙ x‖ ≤ ‖x‖``);
* a ``linear``/``addmm``/``matmul`` by a parameter matrix ``P`` (+ ``b``): ``σ_max(P)·r + ‖b‖``;
* ``cat`` along the features (``√Σ rᵢ²``) or along the tokens (``max rᵢ``), ``where`` and
  ``masked_fill`` (an element-wise choice: ``√(r_a² + r_b²)``).

Example (a first layer reading token and position embeddings)::

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(10, 8), nn.Embedding(4, 8)
            self.q = nn.Linear(8, 8)

        def forward(self, ids):
            return self.q(self.tok(ids) + self.pos(torch.arange(ids.shape[-1])))

    (g,) = capture_graphs(Embed(), torch.zeros(1, 4, dtype=torch.long))
    q = next(n for n in g.gm.graph.nodes if op_of(n) == "linear")
    trace_value_bound(q.args[0], ValueKinds(g.gm.graph, g.example_inputs))
    # ("sum", ("rows", <tok.weight>, 8), ("rows", <the position gather>, 8))
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import (
    VALUE_CASTS, ValueKinds, arg, op_of, scalar_constant, shape_of,
)
from geoscale_fx.analysis.index.index_replay import Unsupported
from geoscale_fx.analysis.norms.normalization import (
    VIEWS, is_last_dim, keeps_last_dim, trace_normalized_input,
)

__all__ = ["trace_value_bound"]

#: in-place spellings this walk reads as their out-of-place op (the node is the result); the
#: shared vocabulary (``graph_ops.op_of``) leaves them unnamed for every other pass
_IN_PLACE_FUNCTIONS = {operator.imul: "mul", operator.iadd: "add", operator.isub: "sub",
                       operator.itruediv: "div"}
_IN_PLACE_METHODS = {"mul_": "mul", "add_": "add", "div_": "div"}
_MAX_DEPTH = 64


def _op(node: Node) -> Optional[str]:
    if node.op == "call_function":
        try:
            in_place = _IN_PLACE_FUNCTIONS.get(node.target)
        except TypeError:
            in_place = None
        return in_place or op_of(node)
    if node.op == "call_method" and node.target in _IN_PLACE_METHODS:
        return _IN_PLACE_METHODS[node.target]
    return op_of(node)


def _width(node) -> Optional[int]:
    shape = shape_of(node)
    return shape[-1] if shape else None


def trace_value_bound(x: Node, kinds: ValueKinds) -> Optional[tuple]:
    """The expression of a bound on ``‖x‖`` per token (``value_radius.evaluate_radius``), or
    None when the walk reaches something the parameters' values do not bound."""
    return _Walk(kinds).bound(x, 0)


class _Walk:
    def __init__(self, kinds: ValueKinds):
        self.kinds = kinds
        self.memo: dict[Node, Optional[tuple]] = {}

    def bound(self, node, depth: int) -> Optional[tuple]:
        if not isinstance(node, Node) or depth > _MAX_DEPTH or _width(node) is None:
            return None
        if node not in self.memo:
            self.memo[node] = self._bound(node, _width(node), depth + 1)
        return self.memo[node]

    def _bound(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        if self.kinds.is_param(node) or self.kinds.is_constant(node):
            return ("rows", node.name, d)
        try:
            norm = trace_normalized_input(node, self.kinds, node)
            ops = tuple((k, v.name if isinstance(v, Node) else float(v))
                        for k, v in norm.channel_ops)
            return ("norm", norm.radius_factor * math.sqrt(norm.model_dim), norm.model_dim,
                    ops)
        except Unsupported:
            pass
        op = _op(node)
        if op in VALUE_CASTS or op == "neg" or (op in VIEWS and keeps_last_dim(node, op)):
            return self._same_width(node.args[0], d, depth)
        if op in ("expand_as", "view_as"):
            return self._same_width(node.args[0], d, depth)
        if op in ("embedding", "index_select"):
            return self._gather(node, op, d, depth)
        if op == "dropout":
            p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
            inner = self._same_width(node.args[0], d, depth)
            return ("scale", inner, 1.0 / (1.0 - p)) if inner and training and p > 0 else inner
        handler = {"add": self._sum, "sub": self._sum, "mul": self._product,
                   "div": self._quotient, "linear": self._linear, "addmm": self._linear,
                   "matmul": self._linear, "cat": self._cat, "where": self._where,
                   "masked_fill": self._masked_fill}.get(op)
        return handler(node, d, depth) if handler is not None else None

    def _same_width(self, node, d: int, depth: int) -> Optional[tuple]:
        """``node``'s bound as a ``d``-vector: equal widths, or a width-1 value broadcast."""
        width = _width(node)
        inner = self.bound(node, depth)
        if inner is None or width not in (1, d):
            return None
        # a width-1 value broadcast (or viewed) over d features: d entries of norm ≤ r each
        return inner if width == d else ("scale", inner, math.sqrt(d))

    def _term(self, value, d: int, depth: int) -> Optional[tuple]:
        """An operand of a sum: a node's bound, or a number broadcast over ``d`` features."""
        c = scalar_constant(value)
        if c is not None:
            return ("const", abs(c) * math.sqrt(d))
        return self._same_width(value, d, depth)

    def _sum(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        alpha = node.kwargs.get("alpha", 1)
        if not isinstance(alpha, (int, float)):
            return None
        terms = [self._term(node.args[0], d, depth), self._term(node.args[1], d, depth)]
        if None in terms:
            return None
        if alpha != 1:
            terms[1] = ("scale", terms[1], alpha)
        return ("sum", *terms)

    def _product(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        a, b = node.args[0], node.args[1]
        for x, m in ((a, b), (b, a)):
            if not isinstance(x, Node) or _width(x) != d:
                continue
            c = scalar_constant(m)
            if c is not None:
                inner = self.bound(x, depth)
                return None if inner is None else ("scale", inner, c)
            if self.kinds.is_param(m) or self.kinds.is_constant(m):
                inner = self.bound(x, depth)
                return None if inner is None else ("gain", inner, m.name)
            if _unit_factor(m):
                return self.bound(x, depth)
        return None

    def _quotient(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        c = scalar_constant(node.args[1])
        if c is None or c == 0 or _width(node.args[0]) != d:
            return None
        inner = self.bound(node.args[0], depth)
        return None if inner is None else ("scale", inner, 1.0 / c)

    def _gather(self, node: Node, op: str, d: int, depth: int) -> Optional[tuple]:
        """Rows picked by (any) indices: at most the largest row of what they are picked
        from (for a parameter table: its largest row, whatever the ids)."""
        if op == "embedding":
            table = node.args[0] if node.target is torch.embedding else arg(node, 1, "weight")
        else:
            table = node.args[0]
            ndim = len(shape_of(table) or ())
            if is_last_dim(arg(node, 1, "dim"), ndim):
                return None
        return self._same_width(table, d, depth) if _width(table) == d else None

    def _linear(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        """``P x + b`` with ``P`` a parameter matrix: ``σ_max(P)·‖x‖ + ‖b‖``."""
        op = _op(node)
        if op == "linear":
            x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
        elif op == "addmm":
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                return None
            b, x, w = node.args[0], node.args[1], node.args[2]
        else:
            x, w, b = node.args[0], node.args[1], None
        if not self.kinds.is_param(w) or len(shape_of(w) or ()) != 2 or \
                (b is not None and not self.kinds.is_param(b)):
            return None
        inner = self.bound(x, depth)
        if inner is None:
            return None
        mapped = ("linear", inner, w.name)
        return mapped if b is None else ("sum", mapped, ("rows", b.name, d))

    def _cat(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        parts = [t for t in arg(node, 0, "tensors")
                 if not (isinstance(t, Node) and math.prod(shape_of(t) or (1,)) == 0)]
        features = is_last_dim(arg(node, 1, "dim", 0), len(shape_of(node) or ()))
        bounds = [self.bound(t, depth) if features else self._same_width(t, d, depth)
                  for t in parts]
        if not bounds or None in bounds:
            return None
        return ("cat" if features else "max", *bounds)

    def _where(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        """Each entry comes from one of the two: ``‖out‖² ≤ ‖a‖² + ‖b‖²``."""
        if len(node.args) != 3:
            return None
        terms = [self._term(v, d, depth) for v in node.args[1:]]
        return None if None in terms else ("cat", *terms)

    def _masked_fill(self, node: Node, d: int, depth: int) -> Optional[tuple]:
        value = scalar_constant(arg(node, 2, "value"))
        inner = self._same_width(node.args[0], d, depth)
        if inner is None or value is None:
            return None
        return inner if value == 0 else ("cat", inner, ("const", abs(value) * math.sqrt(d)))


def _unit_factor(node, depth: int = 0) -> bool:
    """Whether every entry of ``node`` lies in [0, 1] by construction: a boolean tensor (a
    comparison, a logical op, a padding mask handed in) or a sigmoid, through casts, views and
    products of such factors."""
    if not isinstance(node, Node) or depth > 16:
        return False
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return True
    op = _op(node)
    if op == "sigmoid":
        return True
    if op in VALUE_CASTS or op in VIEWS or op in ("expand_as", "view_as"):
        return _unit_factor(node.args[0], depth + 1)
    if op == "mul":
        return all(_unit_factor(a, depth + 1) for a in node.args[:2])
    return False
