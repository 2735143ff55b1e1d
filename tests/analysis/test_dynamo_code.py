"""``release_codes`` lets go of everything Dynamo kept for a fresh code's compiles: the cache
entries, the guard trees (kept by ``weakref.finalize`` callbacks on the objects a guard
matches by identity, such as a module-level function) and the shape environments (kept by a
fake-tensor cycle through C++ and torch's ``ShapeEnv`` memos)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from geoscale_fx.analysis.dynamo_code import fresh_function, note_compile, release_codes

#: full collections walk only what each test makes (``tests/conftest.py``)
pytestmark = pytest.mark.usefixtures("earlier_objects_set_aside")


def _scaled(x):
    return x * 2


def _call(x):
    return _scaled(x) + x.shape[0]      # a guard on the global function, a symbolic size


def _compile_fresh():
    """A fresh copy of ``_call`` compiled with dynamic shapes; its code, guard trees and
    shape environments (weakly)."""
    fresh = fresh_function(_call)
    envs = []

    def backend(gm, example_inputs):
        note_compile()
        envs.append(weakref.ref(torch._guards.TracingContext.try_get().fake_mode.shape_env))
        return gm.forward

    compiled = torch.compile(fresh, backend=backend, dynamic=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 5.0))
    guards = [weakref.ref(e.guard_manager) for e in _debug_get_cache_entry_list(fresh.__code__)]
    return fresh.__code__, guards, envs


@pytest.mark.slow
def test_released_codes_leave_no_guard_tree_and_no_shape_environment():
    code, guards, envs = _compile_fresh()
    assert guards and envs
    gc.collect()
    assert all(g() is not None for g in guards + envs)     # alive while the entries are
    release_codes([code])
    gc.collect()
    gc.collect()                       # what the first collection's callbacks let go of
    assert _debug_get_cache_entry_list(code) == []
    assert [g() for g in guards] == [None] * len(guards)
    assert [e() for e in envs] == [None] * len(envs)


def test_release_leaves_other_compiles_alone():
    kept, kept_guards, kept_envs = _compile_fresh()
    released, _, _ = _compile_fresh()
    release_codes([released])
    gc.collect()
    assert len(_debug_get_cache_entry_list(kept)) == 1
    assert all(g() is not None for g in kept_guards)
    assert kept_envs[0]() is not None and kept_envs[0]().tracked_fakes is not None
    release_codes([kept])


def test_a_fresh_copy_is_the_same_function_but_its_code():
    """A wrapper's keyword-only defaults come with the copy (TRL's fused-LM-head forward,
    ``*, fused_lm_head=False, labels=None``: a copy without them raised ``TypeError`` when
    called with ids alone), and so do its qualified name and attributes."""
    def wrapper(x, scale=2, *, shift=1, labels=None):
        return x * scale + shift if labels is None else labels

    wrapper.__wrapped__ = _scaled
    fresh = fresh_function(wrapper)
    assert fresh.__code__ is not wrapper.__code__
    assert fresh(3) == wrapper(3) == 7 and fresh(3, shift=0, labels=5) == 5
    assert fresh.__kwdefaults__ == {"shift": 1, "labels": None}
    assert fresh.__qualname__ == wrapper.__qualname__ and fresh.__wrapped__ is _scaled
    compiled = torch.compile(fresh_function(wrapper), backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 3.0))
