"""A rewritten graph as ATen operators, so that Inductor's caches can key it.

The rewrite calls each site's program (``compile.rewrite.make_program``), a Python function
made for that site. AOTAutograd's cache refuses a graph whose ``call_function`` targets it
cannot name ("Unsupported call_function target geoscale_…"), so every compile of a
rewritten graph used to trace it again, run the joint-graph passes and look Inductor's
cache up from there — most of what made geoscale's compiles several times plain
Inductor's. ``aten_graph`` traces the rewritten graph once more with ``make_fx`` on the
fake tensors Dynamo gave its inputs (the same shapes and symbols; the scaling state static),
so that what AOTAutograd receives is made of ATen operators and higher-order operators
(flex_attention) only, which its cache keys by value.

A training graph is traced with ``pre_dispatch=True``: above autograd, so what AOTAutograd
differentiates afterwards is the same autograd-level computation (``detach``, grad-mode
changes as ``torch._C._set_grad_enabled`` nodes), and the joint graph, its partition and
the backward are those of the untraced graph. An inference graph is traced below autograd
(no gradient to keep). Graphs with checkpointed regions (``analysis.fx.activation_checkpoint``: nodes
tagged for recomputation, which the trace would drop) and graphs with symbolic shapes are
returned unchanged: the trace
records ``view``s whose legality depends on strides. Tensor-subclass inputs (DTensor) and
graphs compiled outside Dynamo's compile (no fake inputs to trace with) are returned
unchanged too.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["aten_graph"]


def aten_graph(gm: GraphModule, inputs: Sequence[Any], training: bool = False) -> GraphModule:
    """``gm`` traced to ATen operators on the fakes of ``inputs`` (``gm`` itself when it
    cannot be: module docstring); ``training``: above autograd (pre-dispatch). The result
    takes the same inputs and returns the same outputs."""
    context = torch._guards.TracingContext.try_get()
    if context is None or context.fake_mode is None or any(
            isinstance(x, torch.Tensor) and type(x) not in (torch.Tensor, torch.nn.Parameter,
                                                            FakeTensor) for x in inputs):
        return gm
    if any("recompute" in n.meta for n in gm.graph.nodes):
        return gm       # checkpointed regions: AOTAutograd must see their recompute tags
    fake_mode = context.fake_mode
    fakes = [_fake(x, fake_mode, context) for x in inputs]
    if any(_symbolic(x) for x in fakes):
        return gm
    # without make_fx's torch-function metadata mode (``node.meta["torch_fn"]``, which only
    # export reads): flex_attention traces itself with an inner torch.compile whose backend
    # wraps the active modes, a new backend per call, so with the mode every fused site
    # recompiled (4 sites: 4 Dynamo compiles, ~0.1 s each); without it, one per graph
    with fake_mode:
        traced = make_fx(gm, tracing_mode="symbolic", pre_dispatch=training,
                         _disable_torch_fn_metadata_mode=True)(*fakes)
    # a plain GraphModule: the traced one also holds the ShapeEnv, which the cache key
    # would hash (a different key on every run)
    return GraphModule(traced, traced.graph)


def _symbolic(x: Any) -> bool:
    """A symbolic size, or a tensor with one: the trace would record views whose legality
    depends on strides that AOTAutograd's own fakes may not share (a dynamic recompile
    failed with "Cannot view a tensor with shape [s72, 4, 32, 128] and strides …")."""
    if isinstance(x, torch.SymInt):
        return True
    return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)


def _fake(x: Any, fake_mode, context) -> Any:
    """The fake of one input: Dynamo's own for the model's tensors (its symbolic sizes),
    static for the rest (the scaling state)."""
    if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
        return x
    symbolic = context.tensor_to_context.get(x)
    if symbolic is not None:
        return fake_mode.from_tensor(x, symbolic_context=symbolic,
                                     source=symbolic.tensor_source, trace=False)
    return fake_mode.from_tensor(x, static_shapes=True)
