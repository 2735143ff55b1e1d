"""A matmul whose weight is a tensor subclass that computes the product its own way.

Some low-precision training recipes keep ``nn.Linear`` and swap the weight's data for a
tensor subclass whose dispatch quantizes both operands: torchao's MX training
(``MXFP8TrainingOpConfig``: ``MXFP8TrainingWeightWrapperTensor``, blocks of 32 with E8M0
scales). Dynamo's graph then reads ``linear(x, W)`` like any projection, and what runs is an
MX matmul: ``x Wᵀ`` bounds it no better than it bounds an FP8 linear (each operand is
rounded by up to 2⁻⁴ of its value). ``subclass_weight(node)`` says so for a ``linear``,
``addmm`` or ``matmul`` whose weight (through casts, views and transposes) is a graph input
holding such a subclass; a DTensor (tensor parallelism: the same values, sharded), a fake
tensor and a ``Parameter`` are plain. The projection walk stops there with that reason.

Example (a Llama whose linears ``quantize_(…, MXFP8TrainingOpConfig(…))`` converted)::

    subclass_weight(linear)   # "`linear` multiplies by `l_…_q_proj_…_weight_`, a
                              #  MXFP8TrainingWeightWrapperTensor …"
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

from geoscale_fx.analysis.fx.dtensor import dtensor_of
from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, example_value, op_of

__all__ = ["subclass_weight"]

_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)
_WEIGHT_VIEWS = VALUE_CASTS | {"t", "transpose", "permute", "view", "reshape"}


def _weight_input(node: Node) -> Node:
    for _ in range(8):
        if op_of(node) not in _WEIGHT_VIEWS or not node.args or \
                not isinstance(node.args[0], Node):
            break
        node = node.args[0]
    return node


def subclass_weight(node: Node) -> Optional[str]:
    """Why the matmul ``node`` is no projection the bounds know (its weight is a tensor
    subclass that computes the product its own way), or None."""
    op = op_of(node)
    if op not in ("linear", "addmm", "matmul") or len(node.args) < 2:
        return None
    weight = node.args[2] if op == "addmm" and len(node.args) > 2 else node.args[1]
    if not isinstance(weight, Node):
        return None
    root = _weight_input(weight)
    value = example_value(root)
    if not isinstance(value, torch.Tensor) or type(value) in _PLAIN or \
            dtensor_of(value) is not None:
        return None
    return (f"`{node.name}` multiplies by `{root.name}`, a {type(value).__name__} (a tensor "
            "subclass whose dispatch computes the product its own way, e.g. torchao's MX "
            "training weights), so x·Wᵀ does not bound what it outputs")
