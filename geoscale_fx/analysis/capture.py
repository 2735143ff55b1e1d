"""``find_attention``: capture a model with Dynamo exactly as ``torch.compile`` does, then analyse.

Example::

    >>> import torch, geoscale_fx
    >>> layer = torch.nn.TransformerEncoderLayer(64, 4, batch_first=True, norm_first=True)
    >>> sites = geoscale_fx.find_attention(layer, torch.randn(2, 10, 64))
    >>> [(s.name, s.kind, s.n_q_heads, s.supported) for s in sites]
    [('self_attn', 'mha', 4, True)]
    >>> from geoscale_fx.numerics.logit_bounds import site_logit_bound
    >>> site_logit_bound(sites[0]).shape
    torch.Size([4])
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from geoscale_fx.analysis.dynamo_code import fresh_function, note_compile, release_codes
from geoscale_fx.core import compat
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.fx.module_names import attach_model, frame_root, graph_names
from geoscale_fx.sites.model import AttentionSite

__all__ = ["CapturedGraph", "capture_graphs", "find_attention"]


@dataclass
class CapturedGraph:
    """A graph Dynamo handed to a backend, with the example inputs it came with."""
    gm: GraphModule
    example_inputs: list


def capture_graphs(model: torch.nn.Module | Any, *args, dynamic: bool | None = False,
                   graph_mode: Callable[[], contextlib.AbstractContextManager] | None = None,
                   **kwargs) -> list[CapturedGraph]:
    """Run ``torch.compile(model, backend=<recorder>, dynamic=dynamic)(*args, **kwargs)`` once.

    The recorder returns each graph's own ``forward``, so the call executes exactly as
    Dynamo would execute it; ``model`` is not modified and no graph break is added. Shapes
    are static by default, so a capture does not depend on earlier captures' shapes.
    ``graph_mode()``, if given, is entered around each run of a captured graph (a dispatch
    mode cannot be active while Dynamo compiles: ``weightless.ConstantProducts``).

    A module is traced as its class defines it (``_fresh_forward``): a ``forward`` set on the
    instance (a client's wrapper, accelerate's autocast) and a compiled call (``apply_``'s)
    are left out for the capture, so the arguments are those the model's own ``forward``
    takes, and a converted model's compiled call counts no call.
    """
    captured: list[CapturedGraph] = []
    # what the recorder reads, emptied once the capture ran: Dynamo keeps every backend it
    # was given for the process's life, and must not keep the model or its graphs with it
    box = {"root": model if isinstance(model, torch.nn.Module) else None,
           "captured": captured}

    def recorder(gm: GraphModule, example_inputs):
        note_compile()                   # its shape environment is let go with the codes
        # sites are named in ``model`` (a function: in the module its frame reached)
        root = box["root"]
        attach_model(gm, root if root is not None else frame_root(gm))
        graph_names(gm, example_inputs).annotate(gm)     # ``parameter_name`` of its inputs
        box["captured"].append(CapturedGraph(gm, list(example_inputs)))
        if graph_mode is None:
            return gm.forward
        forward = gm.forward

        def run(*inputs):
            with graph_mode():
                return forward(*inputs)
        return run

    # the code Dynamo compiles is a fresh copy (the function, or the module's forward): this
    # capture's cache entries never count against (or hit) the recompile limit of other
    # compiles, and are dropped once it ran (``dynamo_code``)
    codes: list = []
    with _fresh_forward(model, codes) as target:
        compiled = compat.compile_isolated(target, backend=recorder, dynamic=dynamic)
        try:
            compiled(*args, **kwargs)
        finally:
            box.clear()
            release_codes(codes)
    return captured


@contextlib.contextmanager
def _fresh_forward(model, codes: list):
    """``model`` traced as its class defines it, with a fresh copy of that code, whose code
    goes into ``codes``.

    A module: its class's ``forward`` (as an instance attribute for the capture's duration,
    so ``model(...)`` still runs its hooks), below any ``forward`` set on the instance — a
    client's wrapper (TRL's fused LM head, whose keyword-only arguments only its own loss
    call supplies), accelerate's autocast, geoscale's routing — and without the compiled
    call ``apply_`` or ``model.compile()`` installed (``_compiled_call_impl``): the capture
    calls the model with arguments of its own making, which only the model itself is
    known to take. A class that defines no ``forward`` keeps the instance's. A function:
    the function; ``model`` itself where there is no Python function to copy."""
    if isinstance(model, torch.nn.Module):
        with _without_compiled_call(model):
            forward = _defining_forward(model)
            func = getattr(forward, "__func__", forward)
            if not isinstance(func, types.FunctionType):
                yield model
                return
            fresh = fresh_function(func)
            codes.append(fresh.__code__)
            had = "forward" in model.__dict__
            previous = model.__dict__.get("forward")
            model.forward = types.MethodType(fresh, model) if hasattr(forward, "__func__") \
                else fresh
            try:
                yield model
            finally:
                if had:
                    model.forward = previous
                else:
                    del model.__dict__["forward"]
    elif isinstance(model, types.FunctionType):
        fresh = fresh_function(model)
        codes.append(fresh.__code__)
        yield fresh
    else:
        yield model


def _defining_forward(model: torch.nn.Module):
    """The ``forward`` the class defines, as ``model.forward`` would be without an instance
    attribute of that name; the instance's where the class defines none (``nn.Module``'s
    placeholder, which raises)."""
    defined = next(k.__dict__["forward"] for k in type(model).__mro__ if "forward" in k.__dict__)
    if defined is torch.nn.Module.__dict__["forward"]:
        return model.forward
    return defined.__get__(model, type(model)) if hasattr(defined, "__get__") else defined


@contextlib.contextmanager
def _without_compiled_call(model: torch.nn.Module):
    """``model(...)`` runs its own ``_call_impl`` for the duration (no compiled call)."""
    compiled = model.__dict__.get("_compiled_call_impl")
    if compiled is None:
        yield
        return
    model._compiled_call_impl = None
    try:
        yield
    finally:
        model._compiled_call_impl = compiled


def find_attention(model: torch.nn.Module | Any, *args, **kwargs) -> list[AttentionSite]:
    """Every attention site in ``model``'s traced forward, in execution order.

    ``args``/``kwargs`` are passed to the model as in a normal call of its class's
    ``forward`` (``capture_graphs``). Each site says whether
    it could be analysed (``supported``) and why not (``reason``); supported sites are bound
    to the model's current parameters (``head_weights.site_head_weights(site)``,
    ``logit_bounds.site_logit_bound(site)``, ``amax.site_amax_bounds(site)``). Use
    ``site.with_rope_bound("interaction")`` for the paper's (uncertified) RoPE bound.
    """
    sites: list[AttentionSite] = []
    for graph_index, graph in enumerate(capture_graphs(model, *args, **kwargs)):
        sites.extend(analyze_graph(graph.gm, graph.example_inputs, graph_index=graph_index,
                                   first_index=len(sites)))
    return sites
