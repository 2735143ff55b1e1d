"""Evaluate the parameter-only parts of a graph (weights, gains, rotary tables) on demand.

The backend's ``example_inputs`` hold the live parameter tensors, so evaluating a weight
expression (``w.t()``, Gemma's ``1 + w``) gives its *current* value. User inputs are never
read: a node that depends on one evaluates to None.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Node

from geoscale_fx.analysis.fx.graph_ops import ValueKinds

__all__ = ["ParamEvaluator"]


class ParamEvaluator:
    """``evaluate(node)``: the value of a parameter/constant-only node, or None.

    ``weak=True`` holds the inputs' tensors weakly (what a backend keeps about a model must
    not keep its parameters alive): a node read after its tensor was freed raises
    ``ReferenceError`` naming it."""

    def __init__(self, gm: GraphModule, example_inputs: Sequence[Any], kinds: ValueKinds,
                 weak: bool = False):
        self._gm = gm
        self._kinds = kinds
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._inputs = {n: _held(example_inputs[i], weak) if i < len(example_inputs) else None
                        for i, n in enumerate(placeholders)}

    @property
    def kinds(self) -> ValueKinds:
        return self._kinds

    def __call__(self, node: Node) -> torch.Tensor | None:
        return self.evaluate(node)

    def evaluate(self, node: Node, cache: dict | None = None) -> Any:
        if not (self._kinds.is_param(node) or self._kinds.is_constant(node)):
            return None
        cache = {} if cache is None else cache
        with torch.no_grad():
            return self._eval(node, cache)

    def _eval(self, node: Node, cache: dict) -> Any:
        if node in cache:
            return cache[node]
        if node.op == "placeholder":
            value = self._inputs.get(node)
            if isinstance(value, weakref.ref):
                value = value()
                if value is None:
                    raise ReferenceError(f"the tensor behind graph input {node.name!r} was "
                                         "freed (its model was deleted)")
            value = value.detach() if isinstance(value, torch.Tensor) else value
        elif node.op == "get_attr":
            value = self._gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
        else:
            args = torch.fx.node.map_arg(node.args, lambda n: self._eval(n, cache))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self._eval(n, cache))
            if node.op == "call_function":
                value = node.target(*args, **kwargs)
            elif node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.op == "call_module":
                value = self._gm.get_submodule(node.target)(*args, **kwargs)
            else:
                raise ValueError(f"cannot evaluate node {node.name} ({node.op})")
        cache[node] = value
        return value


def _held(value: Any, weak: bool) -> Any:
    return weakref.ref(value) if weak and isinstance(value, torch.Tensor) else value
