"""Code objects of geoscale's own that Dynamo compiles, and how to let go of what it keeps.

Dynamo keeps every code object it compiled, with the cache entries on it (the compiled
graphs, the guards, and the globals it installed for them in the code's module), for the
process's life: on a code object shared by every model (``nn.Module._call_impl``, a
model class's ``forward``) entries pile up until they are invalidated. geoscale therefore
compiles a *fresh* code object of its own per compiled call (``fresh_function``) and, when
what it compiled for is gone (the model is deleted or restored, a region renewed, a capture
done), drops the entries of that code and of the functions Dynamo made to resume it after
graph breaks (``release_codes``): Dynamo then removes its globals, and the graphs, with
whatever they hold, are freed.

    call = fresh_function(lambda *a, **k: model(*a, **k))
    torch.compile(call, backend=...)(x)
    release_codes([call.__code__])
"""
from __future__ import annotations

import types
from typing import Callable

from torch._dynamo.eval_frame import reset_code
from torch._dynamo.resume_execution import ContinueExecutionCache

__all__ = ["fresh_function", "release_codes"]


def fresh_function(fn: Callable) -> types.FunctionType:
    """``fn`` (a Python function) with a code object of its own: Dynamo's frame state,
    counters and cache entries are per code object, so no two compiles share them."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def release_codes(codes: list[types.CodeType]) -> None:
    """Drop Dynamo's compiled entries of ``codes`` and of the functions it made to resume
    them after graph breaks, and forget the codes (``codes`` is emptied)."""
    pending = list(codes)
    while pending:
        code = pending.pop()
        reset_code(code)
        pending += ContinueExecutionCache.cache.get(code, {}).values()
    codes.clear()
