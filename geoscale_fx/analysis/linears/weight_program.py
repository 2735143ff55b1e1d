"""The operations of an ATen graph that compute a linear's dequantized weight, as data.

``weight_program(outputs, weight, tail)`` slices the graph backward from ``outputs`` (the
nodes the matmul reads for its weight operand: the FP8 bits and their scale) to the weight
placeholder, and returns them in graph order as a ``WeightProgram`` (``sites.linear_casts``),
followed by ``tail``: operations the matmul itself applies (``_scaled_mm`` multiplies the
product by the scale; the program writes it as ``float32(bits) · scale``). None when the
slice reads anything but the weight (the input, another tensor: the weight operand would
not be a function of the weight alone) or an operation with a device argument (a program
must run wherever the weight lives).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.fx import Node

from geoscale_fx.sites.linear_casts import Ref, WeightProgram

__all__ = ["weight_program", "TailOp", "PREVIOUS"]

#: an operation appended after the slice: (operator, args, kwargs) whose arguments may be
#: sliced ``Node``\\ s or ``PREVIOUS`` (the result of the operation before it)
TailOp = tuple[Any, tuple, dict]

#: a tail argument: the previous operation's result
PREVIOUS = object()


def _slice(outputs: Sequence[Node], weight: Node) -> Optional[list[Node]]:
    seen, stack = set(), list(outputs)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if node is not weight:
                return None
            continue
        if node.op != "call_function" or not isinstance(
                node.target, torch._ops.OpOverload) or "device" in node.kwargs:
            return None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(weight.graph.nodes)}
    return sorted((n for n in seen if n is not weight), key=order.__getitem__)


def weight_program(outputs: Sequence[Node], weight: Node,
                   tail: Sequence[TailOp] = ()) -> Optional[WeightProgram]:
    """The program of ``outputs`` from ``weight`` then ``tail`` (module docstring)."""
    nodes = _slice(outputs, weight)
    if nodes is None:
        return None
    index = {n: i for i, n in enumerate(nodes)}
    index[weight] = -1

    ops: list = []

    def encode(a):
        if a is PREVIOUS:
            return Ref(len(ops) - 1)
        if isinstance(a, Node):
            return Ref(index[a])
        if isinstance(a, (tuple, list)):    # lists as tuples: the program stays hashable
            return tuple(encode(x) for x in a)
        return a

    for target, args, kwargs in [(n.target, n.args, n.kwargs) for n in nodes] + list(tail):
        ops.append((str(target), encode(tuple(args)),
                    tuple(sorted((k, encode(v)) for k, v in kwargs.items()))))
    return WeightProgram(tuple(ops))
