"""Attaching geoscale to a model: its state, its backend and its compiled call.

Shared by the two forms, ``wrap(model)`` (a wrapper module) and ``apply_(model)`` (in place):

* ``attach_state(model)`` registers the scaling state as the submodule ``geoscale_state`` of
  the model itself, so ``model.state_dict()`` carries it, and hooks ``load_state_dict`` so
  that weights loaded without their state mark every site cold (``detach_state`` undoes
  both, for ``restore_``);
* ``GeoscaleCall`` is the model's compiled call with the checks a user must hear about:
  a call in which Dynamo ran none of our graphs (its recompile limit: the model ran without
  FP8) is counted and warned about once, and a model in which the first call found no
  attention to scale (or left every attention as is) is warned about once.

``isolate_recompiles=True`` gives every attached model its own Dynamo cache: many instances
of one class never reach the recompile limit, which would silently fall back to eager.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from geoscale_fx.config import GeoscaleOptions
from geoscale_fx.backend_sites import ParameterNames
from geoscale_fx.dynamo_backend import GeoscaleBackend
from geoscale_fx.state import STATE_ATTR, GeoscaleState

__all__ = ["STATE_ATTR", "GeoscaleCall", "attach_state", "detach_state",
           "compile_with_geoscale", "compile_module", "disable_hf_auto_compile",
           "enable_hf_auto_compile", "geoscale_call"]

log = logging.getLogger("geoscale_fx")


def attach_state(model: nn.Module) -> GeoscaleState:
    """The model's ``geoscale_state`` submodule, registered (and hooked) on first use."""
    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, GeoscaleState):
        state = GeoscaleState()
        model.add_module(STATE_ATTR, state)
    if not getattr(model, "_geoscale_hooked", False):
        model._geoscale_load_hook = model.register_load_state_dict_post_hook(
            _mark_cold_without_state)
        model._geoscale_hooked = True
    return state


def detach_state(model: nn.Module) -> bool:
    """Undo ``attach_state``: the ``geoscale_state`` submodule and the ``load_state_dict``
    hook go; whether there was a state to remove."""
    found = isinstance(model._modules.get(STATE_ATTR), GeoscaleState)
    if found:
        del model._modules[STATE_ATTR]
    hook = model.__dict__.pop("_geoscale_load_hook", None)
    if hook is not None:
        hook.remove()
    model.__dict__.pop("_geoscale_hooked", None)
    return found


def _mark_cold_without_state(module: nn.Module, incompatible) -> None:
    """After ``load_state_dict``: weights without geoscale state (a plain checkpoint) load
    fine, and every site re-initialises from them at the next call (a cold start)."""
    state = getattr(module, STATE_ATTR, None)
    if not isinstance(state, GeoscaleState):
        return
    missing = [k for k in incompatible.missing_keys if k.startswith(f"{STATE_ATTR}.")]
    for key in missing:
        incompatible.missing_keys.remove(key)
    if missing:
        state.mark_cold()


class GeoscaleCall:
    """A model's compiled call that notices when geoscale did not scale it."""

    def __init__(self, compiled: Callable, backend: GeoscaleBackend, model_name: str):
        self.compiled, self.backend, self.model_name = compiled, backend, model_name
        self.eager_calls = 0      # calls in which none of our compiled graphs ran
        self._checked_sites = False

    @property
    def options(self) -> GeoscaleOptions:
        return self.backend.options

    def __call__(self, *args, **kwargs):
        calls = self.backend.graph_calls
        out = self.compiled(*args, **kwargs)
        if self.backend.graph_calls == calls:
            self._ran_eagerly()
        elif not self._checked_sites:
            self._checked_sites = True
            self._check_sites()
        return out

    def _ran_eagerly(self) -> None:
        """Dynamo ran the model without our graphs (recompile limit, a skipped frame): the
        attention ran in high precision. Say so once, loudly, and count it for ``report``."""
        self.eager_calls += 1
        if self.eager_calls == 1:
            log.warning(
                "geoscale: %s ran eagerly, WITHOUT FP8 attention scaling: Dynamo did not run "
                "its compiled graphs (torch._dynamo.config.recompile_limit=%d reached, or the "
                "frame was skipped). geoscale_fx.report() counts these calls.",
                self.model_name, torch._dynamo.config.recompile_limit)

    def _check_sites(self) -> None:
        """After the first compiled call: a model with nothing scaled is never silent."""
        backend = self.backend
        if backend.records:
            return
        if backend.skipped:
            log.warning("geoscale: %s: all %d attention site(s) found were left as is, none "
                        "uses FP8 scaling (reasons above and in geoscale_fx.report())",
                        self.model_name, len(backend.skipped))
        else:
            log.warning("geoscale: %s: no attention site found in its first call (%d graph(s) "
                        "compiled): nothing uses FP8 scaling; geoscale scales the logits of "
                        "softmax(QKᵀ)·V attention only", self.model_name, backend.compiles)


def compile_with_geoscale(model: nn.Module, options: GeoscaleOptions,
                          compile_fn: Callable[..., Any]) -> GeoscaleCall:
    """Attach the state, build the model's own backend and compile with it.

    ``compile_fn(backend=..., isolate_recompiles=True)`` returns the compiled callable:
    ``torch.compile`` of the model for ``wrap``, ``model.compile`` for ``apply_``.
    """
    state = attach_state(model)
    disable_hf_auto_compile(model)
    backend = GeoscaleBackend(options, state=state, owned=True, qualify=ParameterNames(model))
    compiled = compile_fn(backend=backend, isolate_recompiles=True)
    return GeoscaleCall(compiled, backend, type(model).__name__)


def compile_module(model: nn.Module, **kwargs):
    """What ``model.compile(**kwargs)`` installs, from a frame of ours.

    It calls ``model._call_impl`` (not ``model(...)``), so it can be installed as the model's
    ``_compiled_call_impl`` without calling itself; and Dynamo skips the frame of a
    ``torch.nn`` class's own forward (``model.compile()`` of an ``nn.Sequential`` compiles
    nothing in torch 2.13 and runs eagerly), which a function of ours avoids.
    """
    def call(*args, **kw):
        return model._call_impl(*args, **kw)

    return torch.compile(call, **kwargs)


def disable_hf_auto_compile(model: nn.Module) -> None:
    """Hugging Face ``generate`` compiles ``model.__call__`` itself with Inductor on GPUs with a
    static cache; around geoscale's compiled call that would trace through it and bypass the
    rewrite. geoscale compiles the model, so generate's own compile is turned off."""
    config = getattr(model, "generation_config", None)
    if config is not None and hasattr(config, "disable_compile") and not config.disable_compile:
        model._geoscale_disable_compile_was = config.disable_compile    # False or None
        config.disable_compile = True
        log.info("geoscale: %s.generation_config.disable_compile = True (geoscale compiles "
                 "the model itself)", type(model).__name__)


def enable_hf_auto_compile(model: nn.Module) -> None:
    """Undo ``disable_hf_auto_compile`` (only if it was the one that turned it off)."""
    if "_geoscale_disable_compile_was" in model.__dict__:
        model.generation_config.disable_compile = model.__dict__.pop(
            "_geoscale_disable_compile_was")


def geoscale_call(model: Any) -> GeoscaleCall | None:
    """The ``GeoscaleCall`` of a wrapped (``wrap``) or converted (``apply_``) model, else None."""
    for candidate in (model.__dict__.get("_geoscale_call") if hasattr(model, "__dict__") else None,
                      getattr(model, "_compiled_call_impl", None)):
        if isinstance(candidate, GeoscaleCall):
            return candidate
    return None
