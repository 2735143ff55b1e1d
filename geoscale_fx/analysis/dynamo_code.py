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

A dropped entry's guards would outlive it: Dynamo registers a ``weakref.finalize`` on every
object a guard matches by identity (functions, classes, modules of the traced code, which
live as long as the process), whose callback is the guards' ``invalidate`` — so each compile
of a fresh code kept its guard tree, with the stacks and shape environment it refers to
(≈ 1.5 MB a graph), for the process's life. ``release_codes`` detaches those finalizers of
the entries it drops (``_detach_guard_finalizers``).

So would each compile's shape environment: its ``tracked_fakes`` hold fake tensors whose
symbolic sizes hold the environment again through C++ (``SymInt``), a cycle the garbage
collector cannot see, and torch's ``ShapeEnv`` method memos (class-level ``lru_cache``s keyed
by the environment, two without a bound) keep it too. geoscale's backends call
``note_compile()``, which remembers the environment of the frame being compiled by its
compile id (weakly); ``release_codes`` breaks the cycle of the environments of the entries
it drops and empties those memos (an entry only saves recomputing it, and any entry of
the bounded ones can be evicted at any time).

    call = fresh_function(lambda *a, **k: model(*a, **k))
    torch.compile(call, backend=...)(x)
    release_codes([call.__code__])
"""
from __future__ import annotations

import types
import weakref
from typing import Callable

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
from torch._dynamo.resume_execution import ContinueExecutionCache
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = ["fresh_function", "note_compile", "release_codes"]

#: the shape environment of each frame compile a geoscale backend ran (``note_compile``),
#: by compile id; an entry leaves when its environment is freed
_SHAPE_ENVS: dict = {}


def fresh_function(fn: Callable) -> types.FunctionType:
    """``fn`` (a Python function) with a code object of its own: Dynamo's frame state,
    counters and cache entries are per code object, so no two compiles share them.

    The copy is the same function otherwise: its keyword-only defaults (a wrapper's
    ``*, labels=None``: without them a call leaving one out raises ``TypeError``), qualified
    name and attributes (``__wrapped__``, ``__signature__``) come with it."""
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                               fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__qualname__ = fn.__qualname__
    fresh.__dict__.update(fn.__dict__)
    return fresh


def release_codes(codes: list[types.CodeType]) -> None:
    """Drop Dynamo's compiled entries of ``codes`` and of the functions it made to resume
    them after graph breaks, and forget the codes (``codes`` is emptied)."""
    pending, guards, compiles = list(codes), set(), []
    while pending:
        code = pending.pop()
        for entry in _debug_get_cache_entry_list(code):
            guards.add(id(entry.guard_manager))
            compiles.append(entry.compile_id)
        reset_code(code)
        pending += ContinueExecutionCache.cache.get(code, {}).values()
    codes.clear()
    if guards:
        _detach_guard_finalizers(guards)
    if compiles:
        _release_shape_envs(compiles)


def note_compile() -> None:
    """Remember the shape environment of the frame compile in progress (called by a backend,
    while Dynamo compiles), so that ``release_codes`` can let go of it."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    context = torch._guards.TracingContext.try_get()
    fake_mode = context.fake_mode if context is not None else None
    env = getattr(fake_mode, "shape_env", None)
    if compile_id is None or env is None:
        return
    _SHAPE_ENVS[compile_id] = weakref.ref(
        env, lambda _, key=compile_id: _SHAPE_ENVS.pop(key, None))


def _release_shape_envs(compiles: list) -> int:
    """Break the fake-tensor cycle of the environments of ``compiles`` (their compiled code is
    gone: nothing reads their ``tracked_fakes`` again) and empty torch's ``ShapeEnv``
    memos; the number of environments released."""
    released = 0
    for compile_id in compiles:
        ref = _SHAPE_ENVS.pop(compile_id, None)
        env = ref() if ref is not None else None
        if env is not None:
            env.tracked_fakes = None
            released += 1
    if released:
        for memo in vars(ShapeEnv).values():
            if callable(getattr(memo, "cache_clear", None)):
                memo.cache_clear()
    return released


def _detach_guard_finalizers(guards: set[int]) -> int:
    """Detach the ``weakref.finalize`` callbacks (``CheckFunctionManager.invalidate``) of the
    guard trees whose ids are in ``guards``: their cache entries are gone, so there is
    nothing left to invalidate, and the callbacks were all that kept the trees alive. The
    number detached."""
    detached = 0
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        func = getattr(info[1], "func", None) if info is not None else None
        owner = getattr(func, "__self__", None)
        if getattr(func, "__name__", "") == "invalidate" and \
                id(getattr(owner, "guard_manager", None)) in guards:
            finalizer.detach()
            detached += 1
    return detached
