"""Attaching geoscale to a model: its state, its backend and its compiled call.

Shared by the two forms, ``wrap(model)`` (a wrapper module) and ``apply_(model)`` (in place):

* ``attach_state(model)`` registers the scaling state as the submodule ``geoscale_state`` of
  the model itself, so ``model.state_dict()`` carries it, and hooks ``load_state_dict`` so
  that weights loaded without their state mark every site cold (``detach_state`` undoes
  both, for ``restore_``);
* ``GeoscaleCall`` is the model's compiled call with the checks a user must hear about:
  a call in which Dynamo ran none of our graphs (the model ran without FP8) is counted and
  warned about once, a model in which the first call found no attention to scale (or left
  every attention as is) is warned about once, and so are hooks added to its modules
  between compiles (each addition recompiles); compiles are counted and timed for
  ``report``.

Every attached model compiles its own code object in its own Dynamo cache region
(``isolate_recompiles``), limited to ``RECOMPILE_LIMIT`` entries; a full region is renewed
rather than left to fall back to eager (``CompiledRegion``): a training loop that alternates
grad modes, prompt and completion lengths, fresh and growing caches keeps FP8 on every call.
"""
from __future__ import annotations

import logging
import time
import functools
import inspect
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from geoscale_fx.core import compat
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.compile.decode_lengths import DecodeLengths
from geoscale_fx.compile.dynamo_backend import GeoscaleBackend
from geoscale_fx.analysis.dynamo_code import fresh_function, release_codes
from geoscale_fx.sites.state import STATE_ATTR, GeoscaleState

__all__ = ["STATE_ATTR", "GeoscaleCall", "CompiledRegion", "RECOMPILE_LIMIT", "attach_state", "detach_state",
           "compile_with_geoscale", "compile_module", "route_forward", "unroute_forward", "disable_hf_auto_compile",
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


#: how many compiled entries geoscale lets its call's region hold (Dynamo's own default is 8):
#: a training loop alternates grad modes, fresh and growing caches and a few input
#: layouts (measured: TRL GRPO settles at 9 entries, see ``CompiledRegion``)
RECOMPILE_LIMIT = 32


class CompiledRegion:
    """The model's call compiled in a region of its own, renewed before Dynamo's limit.

    ``compile_fn(limit)`` returns a fresh compile of the call: a new code object (its own frame
    state and counters) in its own cache region (``isolate_recompiles``), limited to
    ``RECOMPILE_LIMIT`` entries. Past that limit Dynamo would run every new state of the
    model eagerly (without FP8); instead, once the region is full, it is dropped with its
    entries and the call compiled afresh, each state again on its first use. A loop with a
    few modes never fills it; one whose guards keep changing (hooks added at every step, a
    new Python constant per call) recompiles, as plain ``torch.compile`` with no limit
    would, but never runs uncompiled and never holds more than ``RECOMPILE_LIMIT`` entries.
    """

    def __init__(self, compile_fn: Callable[[int], Callable]):
        self._compile_fn = compile_fn
        self.limit = RECOMPILE_LIMIT
        #: the code objects compiled so far (Dynamo keeps a compiled code object, and the
        #: entries in its cache, for the process's life: ``release_codes`` frees them)
        self.codes: list[types.CodeType] = []
        self.compiled = self._compile()
        self.renewals = 0

    def _compile(self) -> Callable:
        compiled = self._compile_fn(self.limit)
        original = getattr(compiled, "_torchdynamo_orig_callable", None)
        if original is not None:
            self.codes.append(original.__code__)
        return compiled

    def entries(self) -> int:
        """Compiled entries of the call's frame in the current region."""
        return compat.region_entries(self.compiled)

    def renew_if_full(self, model_name: str) -> bool:
        if self.entries() < self.limit:
            return False
        release_codes(self.codes)
        self.compiled = self._compile()
        self.renewals += 1
        (log.warning if self.renewals == 1 else log.info)(
            "geoscale: %s's compiled call reached %d entries (states that Dynamo's guards "
            "tell apart: grad mode, cache states, shapes, hooks added to modules, ...): "
            "they are dropped and each state compiles again on its next use (renewal %d; "
            "TORCH_LOGS=recompiles lists the reasons)", model_name, self.limit,
            self.renewals)
        return True


class GeoscaleCall:
    """A model's compiled call that notices when geoscale did not scale it, and keeps the
    compiles it needs (``CompiledRegion``) counted and timed for ``report``.

    Called inside another compile (accelerate's ``torch.compile(model)`` under
    ``TrainingArguments(torch_compile=True)``, a user's compiled training step), Dynamo does
    not trace into it (``torch.compiler.disable``: a graph break there): traced through, its
    own compiled call would be inlined into the outer graph, never reaching geoscale's
    backend, and every call would run without FP8. The model is compiled by geoscale, with
    its own ``compiler``; the outer compile's backend and mode take no effect on it."""

    def __init__(self, compile_fn: Callable[[int], Callable], backend: GeoscaleBackend,
                 model_name: str, model: nn.Module | None = None):
        self.region = CompiledRegion(compile_fn)
        self.backend, self.model_name = backend, model_name
        self._model = weakref.ref(model) if model is not None else None
        self._hooks: dict[str, tuple[str, ...]] | None = None   # at the last compile
        self._hooks_warned = False
        self.depth = 0            # > 0 while the compiled call runs (``route_forward``)
        self.probe = OutsideCallProbe(self)
        self.decode_lengths = DecodeLengths()   # a decode step compiles its lengths symbolic
        if model is not None:     # the model deleted: its compiled entries go with it
            self._finalizer = weakref.finalize(model, release_codes, self.region.codes)
        self.calls = 0            # calls of the model through this call
        self.eager_calls = 0      # calls in which none of our compiled graphs ran
        self.compiling_calls = 0  # calls in which Dynamo compiled (or recompiled) a graph
        self.compile_seconds = 0.0   # their wall time (tracing, compiling, and the call)
        self._checked_sites = False

    @property
    def compiled(self) -> Callable:
        return self.region.compiled

    @property
    def options(self) -> GeoscaleOptions:
        return self.backend.options

    @torch.compiler.disable        # never inlined into another compile (the class doc)
    def __call__(self, *args, **kwargs):
        backend = self.backend
        calls, compiles = backend.graph_calls, backend.compiles
        self.calls += 1
        start = time.perf_counter()
        self.decode_lengths.mark(kwargs)
        self.depth += 1
        try:
            out = self.region.compiled(*args, **kwargs)
        finally:
            self.depth -= 1
        if backend.compiles != compiles:
            self.compiling_calls += 1
            self.compile_seconds += time.perf_counter() - start
            self._check_hooks()
            self.region.renew_if_full(self.model_name)
        if backend.graph_calls == calls:
            self._ran_eagerly()
        elif not self._checked_sites:
            self._checked_sites = True
            self._check_sites()
        return out

    def release(self) -> None:
        """The model goes back to plain (``restore_``): the probes come off and Dynamo's
        compiled entries are freed."""
        self.probe.remove()
        release_codes(self.region.codes)

    def _check_hooks(self) -> None:
        """At a compile: modules that gained hooks since the previous compile, said once.
        Dynamo guards on every module's hooks (those of modules that had none excepted), so
        a hook registered again at every step recompiles every state of the model."""
        model = self._model() if self._model is not None else None
        if model is None:
            return
        hooks = module_hooks(model)
        before, self._hooks = self._hooks, hooks
        if before is None or self._hooks_warned:
            return
        grown = [(path, len(before.get(path, ())), names) for path, names in hooks.items()
                 if len(names) > len(before.get(path, ())) and before.get(path)]
        if grown:
            self._hooks_warned = True
            log.warning(
                "geoscale: %s: hooks were added to %s since its previous compile; Dynamo "
                "guards on a module's hooks, so each addition recompiles every state of the "
                "model (a hook registered at every step, as transformers' "
                "enable_input_require_grads is at each gradient-checkpointing enable, "
                "recompiles at every step)", self.model_name,
                "; ".join(f"{path or '(the model)'} ({n} → {len(names)}: "
                          f"{', '.join(sorted(set(names)))})" for path, n, names in grown))

    def _ran_eagerly(self) -> None:
        """Dynamo ran the model without our graphs (a skipped frame, a limit of its own):
        the attention ran in high precision. Say so once, loudly, and count it for
        ``report``."""
        self.eager_calls += 1
        if self.eager_calls == 1:
            log.warning(
                "geoscale: %s ran eagerly, WITHOUT FP8 attention scaling: Dynamo did not run "
                "its compiled graphs (the frame was skipped, or a recompile limit reached). "
                "geoscale_fx.report() counts these calls.", self.model_name)

    def _check_sites(self) -> None:
        """After the first compiled call: a model with nothing scaled is never silent; the
        modules it scales are probed for calls outside this one (``OutsideCallProbe``)."""
        backend = self.backend
        if backend.records:
            model = self._model() if self._model is not None else None
            if model is not None:
                self.probe.install(model, [r.name for r in backend.records.values()])
            return
        if backend.skipped:
            log.warning("geoscale: %s: all %d attention site(s) found were left as is, none "
                        "uses FP8 scaling (reasons above and in geoscale_fx.report())",
                        self.model_name, len(backend.skipped))
        else:
            log.warning("geoscale: %s: no attention site found in its first call (%d graph(s) "
                        "compiled): nothing uses FP8 scaling; geoscale scales the logits of "
                        "softmax(QKᵀ)·V attention only", self.model_name, backend.compiles)


class OutsideCallProbe:
    """Forward pre-hooks on the attention modules geoscale scales, that notice a call of
    one outside the model's compiled call: a method other than ``forward`` that reaches
    it (CLIP's ``get_text_features``), a submodule called directly. That attention runs
    without FP8: such calls are counted (``report``) and said once, naming the module.

    Under Dynamo the hook is a constant no-op (``torch.compiler.is_compiling()``), so the
    compiled graphs are unchanged; inside the compiled call (``GeoscaleCall.depth``) an
    eager run is the eager fallback, counted as such.
    """

    def __init__(self, call: "GeoscaleCall"):
        self._call = weakref.ref(call)
        self._paths = WeakIdKeyDictionary()      # module -> its path in the model
        self._handles: list = []
        self.calls = 0

    def install(self, model: nn.Module, paths: list[str]) -> None:
        for path in dict.fromkeys(paths):
            try:
                module = model.get_submodule(path)
            except AttributeError:        # a site named by its graph node, not a module
                continue
            if module is not model and module not in self._paths:
                self._paths[module] = path
                self._handles.append(module.register_forward_pre_hook(self))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __call__(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            return None
        call = self._call()
        if call is None or call.depth:
            return None
        self.calls += 1
        if self.calls == 1:
            log.warning(
                "geoscale: %s.%s ran outside %s's compiled call (a method other than forward, "
                "or the submodule called directly): its attention ran WITHOUT FP8 scaling; "
                "call the converted model itself (or convert the module that is called). "
                "geoscale_fx.report() counts these calls.", call.model_name,
                self._paths.get(module, type(module).__name__), call.model_name)
        return None


def route_forward(model: nn.Module, call: GeoscaleCall) -> None:
    """``model.forward(...)`` called directly (sentence-transformers, loops calling
    ``.forward``) runs through ``call`` as ``model(...)`` does.

    An instance ``forward`` (a bound method, so that wrappers that rebind
    ``model.forward.__func__`` — accelerate's autocast — keep working) calls the model when
    it is called from outside, and the forward it replaced (the class's, or an instance
    one already there) from inside the compiled call or once the model is restored; it
    keeps that forward's signature (``Trainer`` reads it to select dataset columns).
    ``unroute_forward`` undoes it."""
    previous = model.__dict__.get("forward")
    inner = previous if previous is not None else types.MethodType(type(model).forward, model)

    def forward(self, *args, **kwargs):
        if call.depth or self._compiled_call_impl is not call:
            return inner(*args, **kwargs)
        return self(*args, **kwargs)

    functools.update_wrapper(forward, getattr(inner, "__func__", inner))
    signature = inspect.signature(inner)           # without ``self``, as called
    forward.__signature__ = signature.replace(parameters=[
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
        *signature.parameters.values()])
    model.forward = types.MethodType(forward, model)
    model._geoscale_forward = (model.forward, previous)


def unroute_forward(model: nn.Module) -> None:
    """Undo ``route_forward``: the forward it replaced is the model's again (unless the
    model's ``forward`` was replaced since, which is left as it is)."""
    routed, previous = model.__dict__.pop("_geoscale_forward", (None, None))
    if routed is None or model.__dict__.get("forward") is not routed:
        return
    if previous is None:
        del model.__dict__["forward"]
    else:
        model.forward = previous


def module_hooks(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{module path: qualified names of its forward and forward-pre hooks}``."""
    out = {}
    for path, module in model.named_modules():
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        if hooks:
            out[path] = tuple(getattr(h, "__qualname__", type(h).__name__) for h in hooks)
    return out


def compile_with_geoscale(model: nn.Module, options: GeoscaleOptions) -> GeoscaleCall:
    """Attach the state, build the model's own backend and compile the model's call with
    it (``compile_module``; a fresh compile each time ``CompiledRegion`` renews it)."""
    state = attach_state(model)
    disable_hf_auto_compile(model)
    backend = GeoscaleBackend(options, state=state, owned=True, model=model)
    return GeoscaleCall(lambda limit: compile_module(model, backend=backend.for_dynamo(),
                                                     recompile_limit=limit),
                        backend, type(model).__name__, model)


def compile_module(model: nn.Module, **kwargs):
    """What ``model.compile(**kwargs)`` installs, from a frame of ours.

    It calls ``model._call_impl`` (not ``model(...)``), so it can be installed as the model's
    ``_compiled_call_impl`` without calling itself; and Dynamo skips the frame of a
    ``torch.nn`` class's own forward (``model.compile()`` of an ``nn.Sequential`` compiles
    nothing in torch 2.13 and runs eagerly), which a function of ours avoids.
    """
    def call(*args, **kw):
        return model._call_impl(*args, **kw)

    # a code object of its own per compile (models, renewals): released with the model;
    # its own cache region and recompile limit (``compat.compile_isolated``)
    return compat.compile_isolated(fresh_function(call), **kwargs)


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
