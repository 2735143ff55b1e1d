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
import sys
import types
import weakref
from typing import Any, Callable

import torch
from torch._dynamo import cache_size as dynamo_cache_size
from torch._dynamo import convert_frame, eval_frame

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

    torch ≥ 2.13: ``isolate_recompiles=True`` gives the call its own cache region: every
    frame compiled while it runs — ``fn``'s, and those of shared code (a library's
    decorator wrapper, a model class's ``forward``) reached after a graph break — counts
    only the entries compiled by this call against the limit.
    torch 2.11, 2.12: Dynamo keeps cache entries per code object, so ``fn`` must have a code
    object of its own (``analysis.dynamo_code.fresh_function``) for its entries to be its
    own; on shared code, Dynamo's count is scoped to this call's entries as a region's is
    (``_count_region_entries``); the limit is Dynamo's global ``recompile_limit``, set to
    ``recompile_limit`` while the returned function runs (the limit is read when a frame
    compiles, inside the call).
    """
    if has_isolated_recompiles():
        return torch.compile(fn, isolate_recompiles=True, recompile_limit=recompile_limit,
                             **kwargs)
    compiled = torch.compile(fn, **kwargs)
    region = _compiled_backend(compiled)
    if region is not None:
        _count_region_entries(region)
    if recompile_limit is None:
        return compiled
    patch = torch._dynamo.config.patch

    @functools.wraps(compiled)
    def limited(*args, **kw):
        with patch(recompile_limit=recompile_limit):
            return compiled(*args, **kw)

    return limited


#: the backends of ``compile_isolated``'s calls by id (torch 2.11, 2.12; torch's
#: ``_TorchCompileWrapper`` defines ``__eq__``, not ``__hash__``): Dynamo's count of a frame's
#: entries, compiling for one of them, is that backend's entries alone
_REGIONS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _compiled_backend(compiled: Callable) -> Any:
    """The backend Dynamo stores on the cache entries ``compiled`` (``torch.compile``'s
    function) makes (``CacheEntry.backend``: torch's ``_TorchCompileWrapper``, one per
    ``torch.compile`` call), read from the call's callback (a module's ``OptimizedModule``
    holds its context as ``dynamo_ctx``, a function's wrapper in its closure as ``self``);
    None where not found."""
    context = getattr(compiled, "__dict__", {}).get("dynamo_ctx")
    if context is None and isinstance(compiled, types.FunctionType):
        cells = dict(zip(compiled.__code__.co_freevars, compiled.__closure__ or ()))
        context = cells["self"].cell_contents if "self" in cells else None
    return _innermost_backend(getattr(context, "callback", None))


def _innermost_backend(callback: Any) -> Any:
    """The end of the ``_torchdynamo_orig_backend`` chain of a Dynamo callback (the object
    Dynamo compares with ``CacheEntry.backend``)."""
    while hasattr(callback, "_torchdynamo_orig_backend"):
        callback = callback._torchdynamo_orig_backend
    return callback


def _count_region_entries(region: Any) -> None:
    """torch 2.11, 2.12 (no ``isolate_recompiles``): a frame compiled for ``region`` (a
    backend of ``compile_isolated``) has its recompile limit and recompilation test count
    only the frame's cache entries of that backend — what torch ≥ 2.13 counts in a
    region. Dynamo's ``compute_cache_size``, called by ``ConvertFrameAssert.__call__``,
    is replaced once by ``_region_cache_size``, which gives Dynamo's own count for every
    other backend; the total (``accumulated_recompile_limit``) stays over all entries, as
    in torch ≥ 2.13."""
    _REGIONS[id(region)] = region
    if getattr(convert_frame.compute_cache_size, "_geoscale_regions", False):
        return
    original = convert_frame.compute_cache_size

    def _region_cache_size(frame, cache_entry):
        size = original(frame, cache_entry)
        caller = sys._getframe(1).f_locals.get("self")
        backend = _innermost_backend(getattr(caller, "_torchdynamo_orig_backend", None))
        if backend is None or _REGIONS.get(id(backend)) is not backend:
            return size
        own, entry = 0, cache_entry
        while entry:
            if entry.backend is backend and \
                    dynamo_cache_size._has_same_id_matched_objs(frame, entry):
                own += 1
            entry = entry.next
        size.num_cache_entries_with_same_id_matched_objs = own
        return size

    _region_cache_size._geoscale_regions = True
    convert_frame.compute_cache_size = _region_cache_size


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
