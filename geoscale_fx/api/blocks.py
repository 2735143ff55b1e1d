"""``geoscale_fx.compile_blocks(model, blocks)``: per-block compile, torchtitan's order.

Large models are compiled one transformer block at a time, after tensor parallelism
(``parallelize_module``) and before FSDP2 (``fully_shard``)::

    parallelize_module(block, tp_mesh, plan)            # for every block (optional)
    backend = geoscale_fx.compile_blocks(model, model.layers, compiler="inductor")
    fully_shard(block, mesh=dp_mesh); fully_shard(model)   # optional
    ...
    geoscale_fx.report(model)                           # or report(backend)

Dynamo compiles the block's code once and reuses the graph for every block (parameters are
graph inputs); the backend gives each block's sites their own state, named by the block's
path in ``model`` (``layers.3.attention``), registered on ``model`` as ``geoscale_state``:
``model.state_dict()`` and ``torch.distributed.checkpoint`` carry it, and a resume is warm.
Loading weights without it marks the sites cold (re-initialised from the loaded weights).
With ``alpha="theory"`` the N of α_min counts the heads of every block (the graph's heads
times the number of blocks: exact for identical blocks, an upper bound otherwise).
"""
from __future__ import annotations

from typing import Iterable

from torch import nn

from geoscale_fx.compile.attach import attach_state
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.compile.dynamo_backend import GeoscaleBackend

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, blocks: Iterable[nn.Module], *, fullgraph: bool = False,
                   **options) -> GeoscaleBackend:
    """Compile every module of ``blocks`` in place (``Module.compile``, ``fullgraph`` as in
    ``torch.compile``) with one geoscale backend (options as in ``GeoscaleOptions``) whose
    state lives in ``model``; returns the backend."""
    options = GeoscaleOptions.from_kwargs(**options).without_kv_cache(
        "geoscale_fx.compile_blocks")
    state = attach_state(model)    # registered on the model, load_state_dict hooked
    backend = GeoscaleBackend(options, state=state, owned=True, model=model)
    blocks = list(blocks)
    if not blocks:
        raise ValueError("compile_blocks: no blocks given")
    # a graph compiled for one block serves all alike: alpha="theory" counts N over all of
    # them (an upper bound when blocks differ, which only makes α_min larger, i.e. safer)
    backend.graph_multiplicity = len(blocks)
    compile_graph = backend.for_dynamo()    # one for all blocks: Dynamo reuses the graph
    for block in blocks:
        block.compile(backend=compile_graph, fullgraph=fullgraph)
    model._geoscale_backend = backend         # geoscale_fx.report(model)
    return backend
