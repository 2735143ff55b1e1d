"""``geoscale_fx.wrap(model)``: compile with the geoscale backend and keep its state in the model.

    >>> import torch, geoscale_fx
    >>> layer = torch.nn.TransformerEncoderLayer(32, 4, batch_first=True, norm_first=True)
    >>> fp8 = geoscale_fx.wrap(layer, compiler="aot_eager")

The scaling state (power-iteration vectors, σ, scales, delayed history, calibrated α) is a
submodule ``geoscale_state`` registered *on the model itself*, so ``model.state_dict()`` — the
checkpoint users already save — carries it, and a resumed run starts warm. ``wrapped`` has the
model's own ``state_dict`` keys (no ``_orig_mod.`` prefix). Loading weights without their
scaling state marks every site cold: the next call re-initialises from the loaded weights.
"""
from __future__ import annotations

import functools
import logging

from torch import nn

from geoscale_fx.compile.attach import (
    STATE_ATTR, GeoscaleCall, compile_with_geoscale, geoscale_call,
)
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.kv_cache.manager import KVCacheManager
from geoscale_fx.api.reporting import report
from geoscale_fx.sites.state import GeoscaleState

__all__ = ["GeoscaleModule", "wrap", "STATE_ATTR"]

log = logging.getLogger("geoscale_fx")


class _ModelForward:
    """``GeoscaleModule.forward``, with the wrapped model's ``forward`` signature.

    HF ``Trainer`` reads ``inspect.signature(model.forward)`` to drop dataset columns; a
    ``forward(*args, **kwargs)`` would make it drop every column. A non-data descriptor, so
    that assigning ``wrapped.forward`` (accelerate's autocast under ``bf16=True``) still works.
    """

    def __get__(self, obj, objtype=None):
        if obj is None:      # on the class (HF's find_labels): a plain function
            return _forward

        @functools.wraps(obj._modules["model"].forward)
        def forward(*args, **kwargs):
            return obj._geoscale_call(*args, **kwargs)

        return forward


def _forward(self, *args, **kwargs):
    return self._geoscale_call(*args, **kwargs)


class GeoscaleModule(nn.Module):
    """A model compiled with the geoscale backend; state_dict and attributes are the model's."""

    forward = _ModelForward()

    def __init__(self, model: nn.Module, options: GeoscaleOptions):
        super().__init__()
        if geoscale_call(model) is not None:
            raise ValueError(f"geoscale_fx.wrap: {type(model).__name__} was already converted "
                             "in place by geoscale_fx.apply_; call it directly")
        kv = KVCacheManager(model, options.kv_cache) if options.kv_cache is not None else None
        self.model = model
        model._geoscale_wrapped = True     # apply_ on it would compile it a second time
        self._geoscale_call: GeoscaleCall = compile_with_geoscale(model, options)
        self.geoscale = self._geoscale_call.backend
        if kv is not None:
            model._geoscale_kv_cache = kv

    @property
    def eager_calls(self) -> int:
        """Calls in which none of our compiled graphs ran (the model ran without FP8)."""
        return self._geoscale_call.eager_calls

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self._modules["model"]
            value = getattr(model, name)
            if callable(value) and getattr(value, "__self__", None) is model:
                return self._through_geoscale(value)
            return value

    def _through_geoscale(self, method):
        """``method`` of the model (``generate`` …) with every ``model(...)`` it makes going
        through the geoscale-compiled call, as ``wrapped(...)`` does."""
        model, call = self._modules["model"], self._geoscale_call
        kv = getattr(model, "_geoscale_kv_cache", None) if method.__name__ == "generate" \
            else None

        @functools.wraps(method)
        def run(*args, **kwargs):
            if kv is not None:
                kwargs = kv.generate_kwargs(args, kwargs)
            previous = model._compiled_call_impl
            model._compiled_call_impl = call
            try:
                return method(*args, **kwargs)
            finally:
                model._compiled_call_impl = previous
                if kv is not None:
                    kv.after_generate()

        return run

    @property
    def geoscale_state(self) -> GeoscaleState:
        return getattr(self.model, STATE_ATTR)

    def report(self, per_head: bool = False):
        return report(self, per_head=per_head)


def wrap(model: nn.Module, **options) -> GeoscaleModule:
    """``model`` compiled with geoscale (options as in ``GeoscaleOptions``), state kept in it.

    ``kv_cache="fp8"`` (an option like the others; or ``"fp8_e4m3"``, ``"fp8_e5m2"``):
    ``generate`` keeps keys and values in an FP8 cache whose per-kv-head scales are predicted
    from the weights (``geoscale_fx.kv_cache.manager``), dynamic or static
    (``cache_implementation="static"``). ``kv_cache="nvfp4"``: emulated NVFP4 (``nvfp4.py``).

    The wrapper form: a new module around ``model``. ``geoscale_fx.apply_(model)`` converts
    the model in place instead (same class and methods: ``generate``, ``save_pretrained``).
    """
    return GeoscaleModule(model, GeoscaleOptions.from_kwargs(**options))
