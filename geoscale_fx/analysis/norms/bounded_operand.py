"""Operands bounded by value: no projection, the operand is a view of a bounded tensor.

An attention operand that no parameterised projection produces — Inkling-2's block attention
residual: a learned query vector ``w`` attending over unweighted-RMSNorm'd states — is still
bounded when it is a *view* of a tensor ``x`` whose token vectors are bounded by value:

* a normalization output: ``‖x‖ ≤ ρ√d·max|g| + ‖β‖`` (``normalization.trace_normalized_input``);
* an expression of parameters, gathers and sums (``value_bound.trace_value_bound``): the
  parameter itself gives ``‖w_r‖ ≤ max_r ‖w_r‖``.

Views only between ``x`` and the operand (casts, view/reshape, transpose/permute, expand,
slicing): each head vector is then a slice of one token vector of ``x`` (``head_rows``
refuses a head mixing tokens; ``operand_sides.bounded_side`` a head repeating a channel), so
``‖q_h‖ ≤ ρ`` and the side is ``A_h = I`` on the head's channels of ``x``. A tensor written in
place in the graph (a static KV cache filled by ``index_copy_``) is refused: the bound would
be computed from a value the attention does not read. ``provenance.trace_operand`` falls back
to :func:`bounded_root` when the projection walk is refused.
"""
from __future__ import annotations

from torch.fx import Node

from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, ValueKinds, op_of, shape_of
from geoscale_fx.analysis.index.index_replay import Unsupported
from geoscale_fx.analysis.norms.normalization import VIEWS, trace_normalized_input
from geoscale_fx.analysis.norms.parameter_bound import trace_value_bound
from geoscale_fx.core.parameter_radius import radius_nodes

__all__ = ["bounded_root"]

_IN_PLACE_FUNCTIONS = ("setitem", "iadd", "isub", "imul", "itruediv")


def bounded_root(operand: Node, kinds: ValueKinds) -> tuple[Node, list[Node]] | str:
    """``(x, path)``: the tensor ``operand`` is a view of (through casts and views only,
    ``path`` from after ``x`` to ``operand`` in graph order) when each of ``x``'s token
    vectors is bounded by value — a normalization output (``‖x‖ ≤ ρ√d·max|g| + ‖β‖``) or an
    expression of parameters, gathers and sums (``value_bound.trace_value_bound``). A head
    vector of the operand is then a slice of one such vector: ``‖q_h‖ ≤ ρ``. Otherwise the
    reason, naming the node the walk stopped at."""
    node, path = operand, []
    while op_of(node) in VALUE_CASTS or op_of(node) in VIEWS:
        if not isinstance(node.args[0], Node):
            break
        path.append(node)
        node = node.args[0]
    if not isinstance(shape_of(node), tuple) or not shape_of(node):
        return f"`{node.name}` has no recorded shape"
    try:
        trace_normalized_input(node, kinds, node)
        read = ()
    except Unsupported:
        expr = trace_value_bound(node, kinds)
        if expr is None:
            kind = "a graph input" if node.op == "placeholder" and kinds.is_activation(node) \
                else f"`{op_of(node) or node.op}`"
            return (f"`{node.name}` ({kind}), which it is a view of, is not bounded by the "
                    "parameters' values")
        read = radius_nodes(expr)
    by_name = {n.name: n for n in operand.graph.nodes} if read else {}
    written = [n for n in [node, *path, *(by_name[r] for r in read if r in by_name)]
               if _written_in_place(n)]
    if written:     # a buffer filled in this graph (a static KV cache): not its initial value
        return (f"`{written[0].name}`, which it reads, is written in place in this graph: its "
                "value is not the one the bound would be computed from")
    return node, path[::-1]


def _written_in_place(node: Node, depth: int = 0) -> bool:
    """Whether an in-place op (``x.index_copy_(…)``, ``x[i] = …``, ``x *= …``) writes
    ``node`` or a view of it."""
    for user in node.users:
        if not user.args or user.args[0] is not node:
            continue
        if (user.op == "call_method" and str(user.target).endswith("_")) or (
                user.op == "call_function" and getattr(user.target, "__name__", "") in
                _IN_PLACE_FUNCTIONS):
            return True
        if op_of(user) in VIEWS and depth < 8 and _written_in_place(user, depth + 1):
            return True
    return False
