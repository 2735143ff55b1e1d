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

import logging

import torch
from torch import nn

from geoscale_fx.compiler import GeoscaleBackend, ParameterNames
from geoscale_fx.config import GeoscaleOptions
from geoscale_fx.state import GeoscaleState

__all__ = ["GeoscaleModule", "wrap", "STATE_ATTR", "mark_cold_without_state"]

log = logging.getLogger("geoscale_fx")

STATE_ATTR = "geoscale_state"


class GeoscaleModule(nn.Module):
    """A model compiled with the geoscale backend; state_dict and attributes are the model's."""

    def __init__(self, model: nn.Module, options: GeoscaleOptions):
        super().__init__()
        state = getattr(model, STATE_ATTR, None)
        if not isinstance(state, GeoscaleState):
            state = GeoscaleState()
            model.add_module(STATE_ATTR, state)
        self.model = model
        self.geoscale = GeoscaleBackend(options, state=state, owned=True,
                                        qualify=ParameterNames(model))
        # its own Dynamo cache: many wrapped instances of one class never hit the
        # recompile limit (which would silently fall back to eager, without FP8)
        self._compiled = torch.compile(model, backend=self.geoscale, isolate_recompiles=True)
        self.eager_calls = 0   # calls in which none of our compiled graphs ran
        if not getattr(model, "_geoscale_hooked", False):
            model.register_load_state_dict_post_hook(mark_cold_without_state)
            model._geoscale_hooked = True

    def forward(self, *args, **kwargs):
        runs = self.geoscale.runs
        out = self._compiled(*args, **kwargs)
        if self.geoscale.records and self.geoscale.runs == runs:
            self._ran_eagerly()
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
                type(self.model).__name__, torch._dynamo.config.recompile_limit)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "generate" and not self.__dict__.get("_warned_generate"):
                # the model's own generate() calls its own, uncompiled forward
                self.__dict__["_warned_generate"] = True
                log.warning("geoscale: %s.generate() runs the model WITHOUT FP8 attention "
                            "scaling: it calls the unwrapped forward (generate through "
                            "geoscale is not supported yet)", type(self.model).__name__)
            return getattr(self._modules["model"], name)

    @property
    def geoscale_state(self) -> GeoscaleState:
        return getattr(self.model, STATE_ATTR)

    def report(self, per_head: bool = False):
        from geoscale_fx.reporting import report

        return report(self, per_head=per_head)


def mark_cold_without_state(module: nn.Module, incompatible) -> None:
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


def wrap(model: nn.Module, **options) -> GeoscaleModule:
    """``model`` compiled with geoscale (options as in ``GeoscaleOptions``), state kept in it."""
    return GeoscaleModule(model, GeoscaleOptions.from_kwargs(**options))
