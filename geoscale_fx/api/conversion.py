"""``geoscale_fx.apply_(model)``: convert a model in place, as torchao's ``quantize_`` does.

    >>> import torch, geoscale_fx
    >>> layer = torch.nn.TransformerEncoderLayer(32, 4, batch_first=True, norm_first=True)
    >>> geoscale_fx.apply_(layer, compiler="aot_eager") is layer
    True

The model keeps its class, its ``forward`` signature and every method (``generate``,
``save_pretrained``, ``config``, PEFT's methods): like ``nn.Module.compile``, ``apply_``
routes the model's ``__call__`` through the geoscale backend, so whatever calls
``model(...)`` — ``Trainer``, ``generate`` — runs compiled. The scaling state is the
submodule ``geoscale_state`` (in ``state_dict``, see ``attach``); ``save_pretrained`` writes it
to ``geoscale_state.safetensors`` beside the weights, and ``apply_`` on a model that
``from_pretrained`` loaded from such a directory restores it (``serialization``).
``wrap(model)`` is the wrapper form of the same thing.

``restore_(model)`` is the inverse: the same object again plain (uncompiled, no
``geoscale_state``, the class's own methods), so that its ``state_dict`` loads into a model
geoscale never touched (``plain_state_dict`` gives those keys without restoring).

Refused, each with a ``ValueError`` naming the model: a model compiled already
(``torch.compile``'s ``OptimizedModule``, or ``model.compile()``), a model wrapped by
``wrap``, PEFT prefix tuning (its learned keys enter every attention as a KV cache, not
through the key projection: no attention could be bounded), and ``apply_`` again with other
options. ``apply_`` again with the same options changes nothing and says so.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import fields

import torch._dynamo
from torch import nn

from geoscale_fx.compile.attach import (
    GeoscaleCall, compile_with_geoscale, detach_state, enable_hf_auto_compile, geoscale_call,
    route_forward, unroute_forward,
)
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.kv_cache.manager import KVCacheManager
from geoscale_fx.api.serialization import (STATE_FILE, hook_trainer_resume, install_save_pretrained,
                                       load_state)
from geoscale_fx.sites.state import GeoscaleState
from geoscale_fx.api.wrapper import GeoscaleModule

__all__ = ["apply_", "restore_", "plain_state_dict"]

log = logging.getLogger("geoscale_fx")

#: PEFT methods whose learned keys/values bypass the projections (PEFT's ``PeftType`` names)
_PEFT_KV_METHODS = {"PREFIX_TUNING": "prefix tuning"}


def apply_(model: nn.Module, **options) -> nn.Module:
    """Compile ``model`` in place with the geoscale backend (options as in
    ``GeoscaleOptions``) and return it: same object, same class, state in its state_dict.
    ``kv_cache="fp8"`` (an option like the others): ``model.generate`` keeps an FP8 KV cache
    with scales from the weights (as in ``wrap``; ``kv_cache="nvfp4"``: emulated NVFP4)."""
    opts = GeoscaleOptions.from_kwargs(**options)
    kv = KVCacheManager(model, opts.kv_cache) if opts.kv_cache is not None else None
    name = type(model).__name__
    existing = geoscale_call(model)
    if existing is not None:
        return _again(model, existing, opts)
    _check_convertible(model, name)
    call = compile_with_geoscale(model, opts)
    model._compiled_call_impl = call
    route_forward(model, call)      # model.forward(...) called directly goes through it too
    own = set(model.__dict__)
    if callable(getattr(model, "save_pretrained", None)):   # Hugging Face / PEFT models
        install_save_pretrained(model)
        hook_trainer_resume()
    _restore_beside_weights(model)
    if kv is not None:
        _install_fp8_generate(model, kv)
    # instance attributes over the class's methods, for restore_ to remove
    model._geoscale_methods = tuple(sorted(k for k in _METHODS if k not in own
                                           and k in model.__dict__))
    return model


#: methods ``apply_`` may shadow with an instance attribute
_METHODS = ("save_pretrained", "generate")


def restore_(model: nn.Module) -> nn.Module:
    """Undo ``apply_(model)`` in place and return the plain model: the uncompiled
    ``forward``, no ``geoscale_state`` submodule (nor its ``load_state_dict`` hook), the
    class's own ``save_pretrained`` and ``generate``, ``generation_config.disable_compile``
    as it was. The weights stay as trained. A ``wrap`` wrapper gives back the model it wraps,
    restored the same way. ``ValueError`` if ``model`` was not converted by geoscale."""
    name = type(model).__name__
    if isinstance(model, GeoscaleModule):      # the wrapper is spent afterwards
        model._geoscale_call.release()
        model = model.model
        if not model.__dict__.pop("_geoscale_wrapped", False):
            raise ValueError(f"geoscale_fx.restore_: this wrapper's {type(model).__name__} "
                             "was restored already")
    elif isinstance(getattr(model, "_compiled_call_impl", None), GeoscaleCall):
        call = model.__dict__.pop("_compiled_call_impl")     # back to nn.Module's None
        call.release()
        unroute_forward(model)
    elif model.__dict__.get("_geoscale_wrapped"):
        raise ValueError(f"geoscale_fx.restore_: {name} is wrapped by geoscale_fx.wrap; "
                         "restore the wrapper (restore_(wrapped)), which gives this model back")
    else:
        raise ValueError(f"geoscale_fx.restore_: {name} was not converted by "
                         "geoscale_fx.apply_ (nor wrapped by geoscale_fx.wrap); nothing to "
                         "restore")
    for method in model.__dict__.pop("_geoscale_methods", ()):
        model.__dict__.pop(method, None)
    model.__dict__.pop("_geoscale_kv_cache", None)
    detach_state(model)
    enable_hf_auto_compile(model)
    log.info("geoscale: %s restored: uncompiled, no geoscale state", type(model).__name__)
    return model


def plain_state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` without geoscale's scaling state: the keys of the plain model,
    for ``load_state_dict(..., strict=True)`` into a model geoscale never touched."""
    if isinstance(model, GeoscaleModule):
        model = model.model
    states = [name for name, m in model.named_modules() if isinstance(m, GeoscaleState)]
    prefixes = tuple(f"{name}." if name else "" for name in states)
    if "" in prefixes:        # the model itself is a state
        raise ValueError("geoscale_fx.plain_state_dict: pass the model, not its "
                         "geoscale_state")
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}


def _install_fp8_generate(model: nn.Module, manager: KVCacheManager) -> None:
    """``model.generate`` (an instance attribute over the class's) with an FP8 cache."""
    generate = model.generate
    model._geoscale_kv_cache = manager

    @functools.wraps(generate)
    def generate_fp8(*args, **kwargs):
        kwargs = manager.generate_kwargs(args, kwargs)
        try:
            return generate(*args, **kwargs)
        finally:
            manager.after_generate()

    model.generate = generate_fp8


def _again(model: nn.Module, existing: GeoscaleCall, opts: GeoscaleOptions) -> nn.Module:
    """``apply_`` twice: idempotent with the same options, an error with others."""
    name = type(model).__name__
    if existing.options == opts:
        log.warning("geoscale: apply_(%s) again: it is converted already, with the same "
                    "options; nothing changed", name)
        return model
    changed = [f"{f.name}={getattr(opts, f.name)!r} (converted with "
               f"{getattr(existing.options, f.name)!r})" for f in fields(GeoscaleOptions)
               if getattr(opts, f.name) != getattr(existing.options, f.name)]
    raise ValueError(f"geoscale_fx.apply_: {name} is converted already, with other options: "
                     f"{', '.join(changed)}. Convert a fresh model (its scaling state is in "
                     "model.state_dict()) instead of converting twice")


def _check_convertible(model: nn.Module, name: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"geoscale_fx.apply_: expected an nn.Module, got {name}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        inner = type(model._orig_mod).__name__
        raise ValueError(f"geoscale_fx.apply_: this {inner} is already compiled by "
                         "torch.compile (an OptimizedModule): apply_ compiles it itself; pass "
                         "the uncompiled module (compiled._orig_mod) instead")
    if model._compiled_call_impl is not None:
        raise ValueError(f"geoscale_fx.apply_: {name} was already compiled with "
                         f"{name}.compile(); apply_ would replace that compile. Convert the "
                         "module before compiling it (apply_ compiles it with geoscale)")
    if model.__dict__.get("_geoscale_wrapped"):
        raise ValueError(f"geoscale_fx.apply_: {name} is wrapped by geoscale_fx.wrap already; "
                         "use either the wrapper or the in-place form, not both")
    for peft_config in (getattr(model, "peft_config", None) or {}).values():
        method = _PEFT_KV_METHODS.get(str(getattr(peft_config, "peft_type", "")).split(".")[-1])
        if method is not None:
            raise ValueError(
                f"geoscale_fx.apply_: {name} uses PEFT {method}: its learned prefix keys and "
                "values enter every attention as a KV cache, not through the key projection "
                "of a normalized input, so no attention logit can be bounded and none would "
                "use FP8 (LoRA, prompt tuning and P-tuning keep the projections)")


def _restore_beside_weights(model: nn.Module) -> None:
    """Restore ``geoscale_state.safetensors`` from the directory ``from_pretrained`` read."""
    path = getattr(model, "name_or_path", None)
    if isinstance(path, str) and path and os.path.isfile(os.path.join(path, STATE_FILE)):
        if load_state(model, path):
            log.info("geoscale: %s: scaling state restored from %s (warm start)",
                     type(model).__name__, os.path.join(path, STATE_FILE))
