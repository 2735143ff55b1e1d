"""Inductor's ``compile_fx`` for geoscale's graphs, and what it must not keep of them.

A rewritten graph calls geoscale's per-site programs (``rewrite.make_program``: closures over
the site's plan). Inductor's pre-grad pass ``NumpyCompatNormalization`` memoizes every
``call_function`` target it meets in a process-wide dict, never emptied: each compiled graph
would keep its programs, their plans and sites, for the process's life (a model converted,
run and deleted in a loop grew by megabytes a round). ``compile_fx`` here compiles, then
drops from that memo the targets of the graph that are geoscale's own functions — a memo
entry only saves looking up a signature again, so nothing compiled depends on it.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Sequence

from torch.fx import GraphModule

__all__ = ["compile_fx", "forget_programs"]

_OWN = "geoscale_fx."


def compile_fx(gm: GraphModule, inputs: Sequence[Any], config_patches: dict) -> Callable:
    """``torch._inductor.compile_fx.compile_fx(gm, inputs, config_patches=...)``, leaving no
    geoscale program of ``gm`` in Inductor's process-wide memos."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    try:
        return inductor_compile_fx(gm, inputs, config_patches=config_patches)
    finally:
        forget_programs(gm)


def forget_programs(gm: GraphModule) -> int:
    """Drop ``gm``'s geoscale functions from Inductor's ``call_function`` target memo (the
    number dropped; 0 where this torch has no such memo)."""
    try:
        from torch._inductor.fx_passes.misc_patterns import numpy_compat_normalization
    except ImportError:
        return 0
    memo = getattr(numpy_compat_normalization, "cache", None)
    if not isinstance(memo, dict):
        return 0
    dropped = 0
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, types.FunctionType) and \
                (target.__module__ or "").startswith(_OWN) and memo.pop(target, None) is not None:
            dropped += 1
    return dropped
