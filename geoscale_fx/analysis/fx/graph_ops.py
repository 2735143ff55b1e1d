"""Vocabulary for reading torch-level FX graphs (what Dynamo hands a backend).

The same operation reaches a graph under several spellings — ``torch._C._nn.linear`` or
``F.linear``, ``x.transpose(1, 2)`` (call_method) or ``torch.transpose`` (call_function),
``a * b`` (``operator.mul``) or ``a.mul(b)``. :func:`op_of` maps each to one canonical name so
the passes reason about use-def chains, never about surface forms or module/parameter names.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.fx import Node

from geoscale_fx.analysis.fx.module_names import NAME_META
from geoscale_fx.core import compat

__all__ = [
    "op_of", "arg", "upstream", "baddbmm_args", "matmul_operands", "example_value", "shape_of", "static_int", "scalar_constant", "static_bool",
    "ValueKinds", "parameter_name", "DATA_MOVEMENT", "VALUE_CASTS",
    "DTENSOR_OPS", "strip_casts", "is_last_dim", "same_value",
]

_FUNCTIONS: dict[Any, str] = {
    torch._C._nn.linear: "linear", F.linear: "linear", torch.addmm: "addmm",
    torch.matmul: "matmul", operator.matmul: "matmul", torch.mm: "matmul", torch.bmm: "bmm",
    torch.baddbmm: "baddbmm", torch.einsum: "einsum",
    operator.getitem: "getitem", torch.transpose: "transpose", torch.permute: "permute",
    torch.reshape: "reshape", torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat",
    torch.stack: "stack", torch.split: "split", torch.chunk: "chunk", torch.narrow: "narrow",
    torch.select: "select", torch.squeeze: "squeeze", torch.unsqueeze: "unsqueeze",
    torch.flatten: "flatten", torch.unflatten: "unflatten", torch.movedim: "movedim",
    torch.swapaxes: "transpose", torch.swapdims: "transpose", torch.t: "t",
    torch.repeat_interleave: "repeat_interleave", torch.unbind: "unbind",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    torch.true_divide: "div", operator.add: "add", torch.add: "add", operator.sub: "sub",
    torch.sub: "sub", operator.neg: "neg", torch.neg: "neg",
    # ``S += bias`` (MPNet's position bias): Dynamo rebinds the name to the result node, so
    # as values the in-place operators are their out-of-place ones
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
    F.softmax: "softmax", torch.softmax: "softmax", torch._softmax: "softmax",
    F.dropout: "dropout", torch.dropout: "dropout",
    F.layer_norm: "layer_norm", torch.layer_norm: "layer_norm",
    F.rms_norm: "rms_norm", torch.rms_norm: "rms_norm",
    torch.rsqrt: "rsqrt", torch.sqrt: "sqrt", torch.pow: "pow", operator.pow: "pow",
    torch.square: "square", torch.maximum: "maximum", torch.max: "max",
    torch.mean: "mean", torch.cos: "cos", torch.sin: "sin", torch.tanh: "tanh",
    F.tanh: "tanh",
    torch._C._nn.scaled_dot_product_attention: "sdpa", F.scaled_dot_product_attention: "sdpa",
    F.multi_head_attention_forward: "mha",
    torch._transformer_encoder_layer_fwd: "encoder_layer",
    torch.where: "where", torch.masked_fill: "masked_fill", torch.full: "full",
    torch.clone: "clone", torch.detach: "detach",
    torch.clamp: "clamp", torch.clip: "clamp", torch.clamp_max: "clamp_max",
    torch.clamp_min: "clamp_min", torch.minimum: "minimum", torch.min: "min",
    torch.linalg.vector_norm: "vector_norm", torch.norm: "norm",
    F.embedding: "embedding", torch.embedding: "embedding", torch.index_select: "index_select",
    torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
}

_METHODS: dict[str, str] = {
    "view": "view", "reshape": "reshape", "transpose": "transpose", "permute": "permute",
    "t": "t", "split": "split", "split_with_sizes": "split", "chunk": "chunk",
    "narrow": "narrow", "select": "select", "squeeze": "squeeze", "unsqueeze": "unsqueeze",
    "flatten": "flatten", "unflatten": "unflatten", "expand": "expand",
    "expand_as": "expand_as", "movedim": "movedim", "swapaxes": "transpose",
    "swapdims": "transpose", "repeat": "repeat", "repeat_interleave": "repeat_interleave",
    "unbind": "unbind", "view_as": "view_as", "reshape_as": "view_as",
    "contiguous": "contiguous", "clone": "clone", "detach": "detach",
    "to": "cast", "type": "cast", "float": "cast", "half": "cast", "bfloat16": "cast",
    "double": "cast", "type_as": "cast", "cpu": "cast", "cuda": "cast",
    "mul": "mul", "__mul__": "mul", "__rmul__": "mul", "div": "div", "__truediv__": "div",
    "add": "add", "__add__": "add", "__radd__": "add", "sub": "sub", "__sub__": "sub",
    "neg": "neg", "__neg__": "neg",
    "softmax": "softmax", "matmul": "matmul", "__matmul__": "matmul", "bmm": "bmm",
    "baddbmm": "baddbmm",
    "mm": "matmul", "masked_fill": "masked_fill", "rsqrt": "rsqrt", "sqrt": "sqrt",
    "pow": "pow", "square": "square", "maximum": "maximum", "mean": "mean", "cos": "cos", "sin": "sin", "tanh": "tanh",
    "index_select": "index_select", "sigmoid": "sigmoid",
    "to_local": "to_local", "redistribute": "redistribute", "full_tensor": "full_tensor",
    "clamp": "clamp", "clip": "clamp", "clamp_max": "clamp_max", "minimum": "minimum",
    "min": "min", "norm": "norm", "clamp_min": "clamp_min",
}

try:  # tensor parallelism: DTensor's constructor from a local tensor (analysis/fx/dtensor.py)
    from torch.distributed.tensor._api import from_local as _from_local

    _FUNCTIONS[_from_local] = "from_local"
except ImportError:  # a build without torch.distributed
    pass

#: Ops that only move or copy elements (value semantics preserved element-wise).
DATA_MOVEMENT = frozenset({
    "view", "reshape", "transpose", "permute", "t", "getitem", "split", "chunk", "narrow",
    "select", "squeeze", "unsqueeze", "flatten", "unflatten", "expand", "expand_as",
    "movedim", "repeat", "repeat_interleave", "unbind", "view_as", "cat", "stack",
})

#: DTensor's API in a graph (tensor parallelism; read by ``analysis/fx/dtensor.py``).
DTENSOR_OPS = frozenset({"from_local", "to_local", "redistribute", "full_tensor"})

#: Ops that keep every value (up to rounding): dtype/device casts and copies.
VALUE_CASTS = frozenset({"cast", "contiguous", "clone", "detach"})


def op_of(node: Node) -> str | None:
    """Canonical op name of ``node`` (``"linear"``, ``"view"``, ``"sdpa"``, …) or None."""
    if node.op == "call_function":
        try:
            op = _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
        return op if op is not None else compat.traced_dtensor_method(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def baddbmm_args(node: Node) -> tuple[Any, Any, Any, float, float]:
    """``(bias, batch1, batch2, beta, alpha)`` of ``torch.baddbmm`` or ``bias.baddbmm``."""
    bias = arg(node, 0, "input")
    b1, b2 = arg(node, 1, "batch1"), arg(node, 2, "batch2")
    return bias, b1, b2, float(arg(node, 3, "beta", 1.0)), float(arg(node, 4, "alpha", 1.0))


def matmul_operands(node: Node) -> tuple[Any, Any]:
    """The two multiplied operands of a matmul/bmm/baddbmm/einsum node."""
    op = op_of(node)
    if op == "baddbmm":
        return baddbmm_args(node)[1:3]
    if op == "einsum":
        return tuple(node.args[-2:])
    return tuple(node.args[:2])


def upstream(start: Iterable[Node], follow: Callable[[Node], bool] | None = None,
             depth: int | None = None) -> Iterator[Node]:
    """Every node reachable backwards from ``start`` (depth first, each once); the inputs of
    a node are visited only if ``follow(node)`` (default: always), and only nodes at most
    ``depth`` inputs away from ``start`` (default: any)."""
    stack, seen = [(node, 0) for node in start], set()
    while stack:
        node, d = stack.pop()
        if node in seen or (depth is not None and d > depth):
            continue
        seen.add(node)
        yield node
        if follow is None or follow(node):
            stack.extend((n, d + 1) for n in node.all_input_nodes)


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``, given positionally at ``index`` or as a keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def example_value(node: Any) -> Any:
    """The fake/real value Dynamo recorded for ``node`` (``meta['example_value']``)."""
    if isinstance(node, Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def shape_of(node: Any) -> tuple[int, ...] | None:
    value = example_value(node)
    if isinstance(value, torch.Tensor):
        return tuple(static_int(s) for s in value.shape)
    return None


def static_int(value: Any) -> int:
    """An int from an int or a SymInt (its hint: the size seen at compile time)."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else int(value)
    return int(value)


def scalar_constant(value: Any) -> float | None:
    """A Python number behind ``value`` (a literal, or a node Dynamo folded to a number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, Node):
        ev = example_value(value)
        if isinstance(ev, (int, float)) and not isinstance(ev, bool):
            return float(ev)
        if isinstance(ev, (torch.SymInt, torch.SymFloat)):
            hint = ev.node.hint
            return float(hint) if hint is not None else None
        if op_of(value) == "full" and not any(isinstance(a, Node) for a in value.args):
            size, fill = value.args[0], arg(value, 1, "fill_value")
            if isinstance(fill, (int, float)) and math.prod(size) == 1:
                return float(fill)
        if value.target in (torch.scalar_tensor, torch.tensor) and value.args and \
                isinstance(value.args[0], (int, float)) and not isinstance(value.args[0], bool):
            return float(value.args[0])      # ``torch.scalar_tensor(0)`` as a fill value
        folded = _fold(value)
        if folded is not None and folded.numel() == 1:
            return float(folded)
    return None


#: ops a one-element constant is folded through (``scalar_constant``)
_FOLDABLE = frozenset({"mul", "div", "add", "sub", "neg", "sqrt", "rsqrt", "pow", "cast",
                       "contiguous", "clone", "detach"})


def _fold(node: Any, depth: int = 8) -> torch.Tensor | None:
    """The value of a small constant expression, computed as the graph would (its dtype
    casts included): DeBERTa's scale ``sqrt(tensor(d_h, dtype=float) · 3).to(dtype)``.
    None where any input is not a literal or such an expression."""
    if not isinstance(node, Node):
        return node if isinstance(node, (int, float, torch.dtype)) and \
            not isinstance(node, bool) else None
    if depth == 0 or node.op not in ("call_function", "call_method"):
        return None
    if node.target is torch.tensor:
        literal = node.args[0] if node.args else None
        if not isinstance(literal, (int, float)) or isinstance(literal, bool) or \
                any(isinstance(v, Node) for v in node.kwargs.values()):
            return None
        return torch.tensor(literal, **{k: v for k, v in node.kwargs.items()
                                        if k == "dtype"})
    if op_of(node) not in _FOLDABLE:
        return None
    args = [_fold(a, depth - 1) if isinstance(a, Node) else a for a in node.args]
    if any(a is None for a in args) or not any(isinstance(a, torch.Tensor) for a in args) or \
            any(isinstance(v, Node) for v in node.kwargs.values()):
        return None
    kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "alpha")}
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def static_bool(value: Any) -> bool:
    """A Python bool behind ``value`` (literal, or a SymBool node's compile-time hint)."""
    if isinstance(value, Node):
        value = example_value(value)
    if isinstance(value, torch.SymBool):
        hint = value.node.hint
        return bool(hint) if hint is not None else bool(value)
    return bool(value)


class ValueKinds:
    """Which nodes depend only on parameters/buffers/constants ("param") vs user inputs.

    A projection weight, a normalization gain or a bias must be a "param" node: a function of
    the model's state alone, so the rewrite can recompute it every step from the weights.
    """

    def __init__(self, graph: torch.fx.Graph, example_inputs: Iterable[Any] | None = None):
        inputs = list(example_inputs) if example_inputs is not None else None
        self._kind: dict[Node, str] = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            value = inputs[i] if inputs is not None and i < len(inputs) else example_value(node)
            self._kind[node] = "param" if _is_state(node, value) else "input"
        for node in graph.nodes:
            if node in self._kind:
                continue
            if node.op == "get_attr":
                self._kind[node] = "param"
                continue
            kinds = {self._kind.get(n, "input") for n in node.all_input_nodes}
            self._kind[node] = ("input" if "input" in kinds else
                                "param" if "param" in kinds else "const")

    def is_param(self, node: Any) -> bool:
        """True for nodes computed from parameters/buffers (and constants) only."""
        return isinstance(node, Node) and self._kind.get(node) == "param"

    def is_activation(self, node: Any) -> bool:
        return isinstance(node, Node) and self._kind.get(node) == "input"

    def is_constant(self, node: Any) -> bool:
        return isinstance(node, Node) and self._kind.get(node) == "const"


def _is_state(node: Node, value: Any) -> bool:
    if isinstance(value, torch.nn.Parameter):
        return True
    source = getattr(node, "_dynamo_source", None)
    name = source.name if source is not None and hasattr(source, "name") else ""
    name = name() if callable(name) else name
    return "_parameters[" in name or "_buffers[" in name or ".parameters." in name


def parameter_name(node: Node) -> str:
    """The model's name of the parameter or buffer behind a placeholder, found by identity
    when the graph was analysed (``analysis.fx.module_names``), else the node's name."""
    return node.meta.get(NAME_META) or node.name


def strip_casts(node):
    while isinstance(node, Node) and op_of(node) in VALUE_CASTS:
        node = node.args[0]
    return node


def is_last_dim(dim, ndim) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and is_last_dim(dim[0], ndim)
    return dim in (-1, ndim - 1)


def same_value(a, b, depth: int = 4) -> bool:
    """Whether two graph values are the same computation: one node, or the same op on the
    same arguments (a hand-written LayerNorm computes ``x − mean(x)`` twice)."""
    if a is b:
        return True
    if not (isinstance(a, Node) and isinstance(b, Node)) or depth == 0:
        return not isinstance(a, Node) and not isinstance(b, Node) and a == b
    if (a.op, a.target) != (b.op, b.target) or len(a.args) != len(b.args) or \
            a.kwargs != b.kwargs or a.op not in ("call_function", "call_method"):
        return False
    return all(same_value(x, y, depth - 1) for x, y in zip(a.args, b.args))
