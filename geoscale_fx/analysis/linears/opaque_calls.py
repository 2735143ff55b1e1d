"""An opaque call of a Dynamo graph traced to ATen operators, so that its arithmetic can be read.

Dynamo keeps some functions whole: an autograd function marked
``torch._dynamo.allow_in_graph`` (torchao's FP8 linear is one) is a single ``call_function``
node whose target Dynamo made (``trampoline_autograd_apply``), its non-tensor arguments
built by constant nodes of the graph (torchao's ``Float8LinearConfig(...)``). What the call
computes is not in the graph. ``traced_call`` traces it again with ``make_fx`` on fake
tensors of its arguments' recorded shapes and dtypes (nothing is computed, no weight is
read), the constant arguments evaluated as the graph builds them, and returns the ATen
graph with its placeholders in the order of the call's tensor arguments
(``call_signature``: what the trace depends on, its ``key`` to cache answers by).

Only calls that the graph vocabulary does not know (``graph_ops.op_of`` is None), with one
to four tensor arguments and every other argument a constant, are traced; anything that
fails to trace is not one (None, logged at debug level).

Example (a Float8Linear's node ``output`` in Llama's graph)::

    traced = traced_call(call_signature(output, kinds))
    traced.tensor_args        # (hidden_states_2, t): the input and the transposed weight
    traced.graph              # abs, amax, …, _to_copy(float8_e4m3fn), _scaled_mm, view
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from geoscale_fx.analysis.fx.graph_ops import ValueKinds, example_value, op_of, static_int

__all__ = ["TracedCall", "CallSignature", "call_signature", "traced_call", "call_name",
           "untraceable_tensor", "MAX_TENSOR_ARGS"]

log = logging.getLogger("geoscale_fx")

#: calls with more tensor arguments are not traced (a linear takes an input and a weight,
#: a few scales at most)
MAX_TENSOR_ARGS = 4


@dataclass(frozen=True)
class TracedCall:
    """The ATen graph of an opaque call; placeholder ``i`` is ``tensor_args[i]``."""
    graph: GraphModule
    tensor_args: tuple[Node, ...]

    def argument(self, placeholder: Node) -> Node:
        """The call's graph node behind one of the trace's placeholders."""
        placeholders = [n for n in self.graph.graph.nodes if n.op == "placeholder"]
        return self.tensor_args[placeholders.index(placeholder)]


def _function(target: Any) -> Any:
    """The autograd function behind Dynamo's trampoline (its closure holds the class; each
    compile makes a new trampoline), else the target itself."""
    for cell in getattr(target, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, type) and hasattr(value, "apply"):
            return value
    return target


def call_name(target: Any) -> str:
    """What a call's target is called: the autograd function behind Dynamo's trampoline,
    else the function's own name."""
    function = _function(target)
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", str(function))


def _opaque(node: Node) -> bool:
    if node.op != "call_function" or op_of(node) is not None:
        return False
    target = node.target
    return callable(target) and not isinstance(
        target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and \
        getattr(target, "__module__", None) not in ("_operator", operator.__name__)


def _constant(node: Node, kinds: ValueKinds, depth: int = 8) -> Any:
    """The value of a constant node (built from literals only), as the graph computes it."""
    if not kinds.is_constant(node) or depth == 0 or node.op not in ("call_function",
                                                                    "call_method"):
        raise ValueError(f"`{node.name}` is not a constant built from literals")
    args = torch.fx.node.map_arg(node.args, lambda n: _constant(n, kinds, depth - 1))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _constant(n, kinds, depth - 1))
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def untraceable_tensor(node: Node) -> Optional[str]:
    """The type of a tensor argument of the opaque call ``node`` that cannot be faked for a
    trace (a tensor subclass: a DTensor, a weight wrapper), or None."""
    if not _opaque(node):
        return None
    for a in (*node.args, *node.kwargs.values()):
        value = example_value(a) if isinstance(a, Node) else None
        if isinstance(value, torch.Tensor) and _tensor_spec(a) is None:
            return type(value).__name__
    return None


def _tensor_spec(node: Node) -> Optional[tuple]:
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or type(value).__name__ not in (
            "FakeTensor", "Tensor", "Parameter"):
        return None
    return (tuple(static_int(s) for s in value.shape), value.dtype, value.device)


@dataclass(frozen=True)
class CallSignature:
    """What a trace of an opaque call depends on: its target, its tensor arguments' specs
    (shape, dtype, device) and its constant arguments' values (``key``, hashable), and the
    call's tensor argument nodes in order."""
    node: Node
    args: tuple
    kwargs: tuple
    tensors: tuple[Node, ...]
    specs: tuple[tuple, ...]

    @property
    def key(self) -> Optional[tuple]:
        try:
            key = (_function(self.node.target), self.specs, repr(self.args), repr(self.kwargs))
            hash(key)
            return key
        except TypeError:
            return None


def call_signature(node: Node, kinds: ValueKinds) -> Optional[CallSignature]:
    """The signature of the opaque call ``node`` (module docstring), or None when it is not
    one (a known op, an argument neither a tensor nor a constant, too many tensors)."""
    if not _opaque(node):
        return None
    tensors: list[Node] = []
    specs: list[tuple] = []

    def argument(a):
        if not isinstance(a, Node):
            return a
        spec = _tensor_spec(a)
        if spec is not None:
            tensors.append(a)
            specs.append(spec)
            return _Slot(len(tensors) - 1)
        return _constant(a, kinds)

    try:
        args = tuple(argument(a) for a in node.args)
        kwargs = tuple((k, argument(v)) for k, v in node.kwargs.items())
    except Exception as exc:  # noqa: BLE001 — an argument that is no constant: not ours
        log.debug("geoscale: %s: not traced (%s)", node.name, exc)
        return None
    if not 1 <= len(tensors) <= MAX_TENSOR_ARGS:
        return None
    return CallSignature(node, args, kwargs, tuple(tensors), tuple(specs))


def traced_call(signature: CallSignature) -> Optional[TracedCall]:
    """The ATen graph of the call (module docstring), or None when it does not trace."""
    node, args, kwargs = signature.node, signature.args, dict(signature.kwargs)

    def call(*values):
        def put(a):
            return values[a.index] if isinstance(a, _Slot) else a
        return node.target(*(put(a) for a in args), **{k: put(v) for k, v in kwargs.items()})

    try:
        with FakeTensorMode():
            fakes = [torch.empty(shape, dtype=dtype, device=device)
                     for shape, dtype, device in signature.specs]
            graph = make_fx(call, tracing_mode="real")(*fakes)
    except Exception as exc:  # noqa: BLE001 — a call that does not trace is left opaque
        log.debug("geoscale: %s (%s) does not trace to ATen operators: %s: %s", node.name,
                  call_name(node.target), type(exc).__name__, exc)
        return None
    return TracedCall(GraphModule(graph, graph.graph), signature.tensors)


@dataclass(frozen=True)
class _Slot:
    index: int
