"""What differs between the torch releases geoscale supports (2.11 to 2.15): one function per
feature, each saying which releases need its fallback.

The package asks this module, never ``torch.__version__``. A feature is detected by what the
installed torch has (a keyword, a function), not by its version number, so a backport or a
nightly answers correctly; the docstrings name the releases each branch is for. Where an
older release lacks what an option needs, the option says so by name and release, never a
silently different behaviour.

    compiled = compat.compile_isolated(fn, backend="eager", recompile_limit=32)
    compiled(x)
    compat.region_entries(compiled)        # the compiled entries of fn's own region
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch._dynamo import eval_frame

__all__ = ["compile_isolated", "region_entries", "has_isolated_recompiles",
           "resolve_source_value", "traced_dtensor_method"]


@functools.lru_cache(maxsize=None)
def has_isolated_recompiles() -> bool:
    """``torch.compile(isolate_recompiles=..., recompile_limit=...)``: a cache region and a
    recompile limit of the compiled function's own. torch ≥ 2.13; 2.11 and 2.12 have
    neither keyword (one process-wide ``torch._dynamo.config.recompile_limit``)."""
    parameters = inspect.signature(torch.compile).parameters
    return "isolate_recompiles" in parameters and "recompile_limit" in parameters


def compile_isolated(fn: Callable, *, recompile_limit: int | None = None, **kwargs) -> Callable:
    """``torch.compile(fn, **kwargs)`` whose compiled entries count against a limit of its
    own (``recompile_limit``; Dynamo's global one where None).

    torch ≥ 2.13: ``isolate_recompiles=True`` gives the call its own cache region.
    torch 2.11, 2.12: Dynamo keeps cache entries per code object, so ``fn`` must have a code
    object of its own (``analysis.dynamo_code.fresh_function``) for its entries to be its
    own; the limit is Dynamo's global ``recompile_limit``, set to ``recompile_limit`` while
    the returned function runs (the limit is read when a frame compiles, inside the call).
    Frames of shared code reached after a graph break count against the process's entries
    there, as they do under plain ``torch.compile``.
    """
    if has_isolated_recompiles():
        return torch.compile(fn, isolate_recompiles=True, recompile_limit=recompile_limit,
                             **kwargs)
    compiled = torch.compile(fn, **kwargs)
    if recompile_limit is None:
        return compiled
    patch = torch._dynamo.config.patch

    @functools.wraps(compiled)
    def limited(*args, **kw):
        with patch(recompile_limit=recompile_limit):
            return compiled(*args, **kw)

    return limited


def region_entries(compiled: Callable) -> int:
    """How many compiled entries the region of ``compiled`` (from ``compile_isolated``)
    holds for its own frame. torch ≥ 2.13: the entries of its region; 2.11, 2.12: the
    entries of its code object (its own, see ``compile_isolated``)."""
    code = compiled._torchdynamo_orig_callable.__code__
    region = getattr(compiled, "_isolate_recompiles_id", None)
    if region is not None and hasattr(eval_frame, "_get_cache_entries_for_region"):
        return len(eval_frame._get_cache_entries_for_region(code, region))
    return len(eval_frame._debug_get_cache_entry_list(code))


def resolve_source_value(output, source) -> Any:
    """The value Dynamo's ``source`` names in the frame ``output`` (an ``OutputGraph``) is
    compiling. torch ≥ 2.12: ``OutputGraph.resolve_source_value``; torch 2.11 has no such
    method, and the same evaluation is spelled out (``Source.get_value`` against the root
    frame's globals and locals)."""
    resolve = getattr(output, "resolve_source_value", None)
    if resolve is not None:
        return resolve(source)
    frame = output.root_tx
    return source.get_value({"G": frame.f_globals, "L": frame.f_locals}, {}, {})


#: what torch 2.11's Dynamo names the functions it records for DTensor's API
_DTENSOR_METHOD_FUNCTIONS = {"prim_redistribute": "redistribute", "prim_to_local": "to_local",
                             "prim from_local": "from_local"}


def traced_dtensor_method(target: Any) -> str | None:
    """The DTensor call (``"redistribute"``, ``"to_local"``, ``"from_local"``) a graph's
    ``call_function`` node stands for, where Dynamo recorded it as a function of its own:
    torch 2.11 records ``DTensor.redistribute``, ``DTensor.to_local`` and
    ``DTensor.from_local`` as closures (``prim_redistribute``, ``prim_to_local``,
    ``prim from_local``) holding the call's other arguments (placements among them), the
    tensor their one argument; torch ≥ 2.12 records the methods and the function themselves,
    and this is None."""
    return _DTENSOR_METHOD_FUNCTIONS.get(getattr(target, "__name__", None))
