"""Scaling state as module state: per-site buffers that ``state_dict`` carries.

Every rewritten attention owns a few tensors (power-iteration vectors, the last σ / bound /
scale, delayed-scaling history, overflow counters, auto-α calibration). They are passed to the
compiled graph as extra inputs and updated in place, so they persist across calls and
recompiles. ``GeoscaleState`` (an ``nn.Module``) holds them as buffers, so a checkpoint of the
model (``wrap`` registers it on the model) resumes warm instead of cold.

Loading a state_dict before the sites exist (a fresh process: sites appear at the first
compile) stashes the entries; each site picks its own up when it is created.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["STATE_ATTR", "StateSpec", "SiteState", "GeoscaleState", "site_key"]

log = logging.getLogger("geoscale_fx")

#: The submodule name under which a converted model holds its ``GeoscaleState`` (so that
#: ``model.state_dict()`` carries it as ``geoscale_state.*``).
STATE_ATTR = "geoscale_state"


@dataclass(frozen=True)
class StateSpec:
    """Name, shape, dtype and initial value of one state tensor."""
    name: str
    shape: tuple[int, ...]
    fill: float | Callable[[], torch.Tensor] = 0.0
    dtype: torch.dtype = torch.float32
    warm: bool = False            # restoring it from a checkpoint makes the site warm


def site_key(name: str, taken) -> str:
    """A module-name-safe key for a site (``transformer.h.0.attn`` → ``transformer_h_0_attn``)."""
    base = re.sub(r"[^0-9A-Za-z_]", "_", name) or "site"
    key, i = base, 1
    while key in taken:
        i += 1
        key = f"{base}_{i}"
    return key


class SiteState(nn.Module):
    """The buffers of one attention site, in the order the compiled graph takes them."""

    def __init__(self, specs: list[StateSpec], device: torch.device):
        super().__init__()
        self.names: tuple[str, ...] = tuple(s.name for s in specs)
        self.warm_names = frozenset(s.name for s in specs if s.warm)
        self.key = ""             # the site's key in ``GeoscaleState`` (seeds its cold start)
        self.cold = True          # host-side: the next call initialises from the weights
        self.calib_seen: int | None = None   # host-side mirror of calib_count (auto-α)
        for spec in specs:
            value = spec.fill() if callable(spec.fill) else torch.full(spec.shape, spec.fill)
            self.register_buffer(spec.name, value.to(device=device, dtype=spec.dtype))

    def tensors(self, names: tuple[str, ...] | None = None) -> list[torch.Tensor]:
        """The buffers ``names`` (default: all), in that order."""
        return [getattr(self, n) for n in (self.names if names is None else names)]

    def fits(self, specs: list[StateSpec]) -> bool:
        """Every buffer ``specs`` names that this state has, it has with that shape."""
        return all(tuple(getattr(self, s.name).shape) == tuple(s.shape)
                   for s in specs if s.name in self.names)

    def extend(self, specs: list[StateSpec], device: torch.device) -> None:
        """Add the buffers of ``specs`` this state lacks (another graph of the same site,
        e.g. decode after prefill, needs state of its own). New buffers are initialised at
        the next cold start, so the site is marked cold."""
        new = [s for s in specs if s.name not in self.names]
        for spec in new:
            value = spec.fill() if callable(spec.fill) else torch.full(spec.shape, spec.fill)
            self.register_buffer(spec.name, value.to(device=device, dtype=spec.dtype))
        if new:
            self.names = self.names + tuple(s.name for s in new)
            self.warm_names = self.warm_names | {s.name for s in new if s.warm}
            self.cold = True

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.names}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Copy checkpointed values in place (the graph holds these very tensors)."""
        copied = set()
        for name, value in saved.items():
            if name not in self.names:
                continue
            target = getattr(self, name)
            if tuple(value.shape) != tuple(target.shape):
                log.warning("geoscale: checkpointed %s has shape %s, the site needs %s; "
                            "ignored", name, tuple(value.shape), tuple(target.shape))
                continue
            with torch.no_grad():
                target.copy_(value)
            copied.add(name)
        if _warm(self.warm_names, copied):
            self.cold = False
        self.calib_seen = None


def _warm(warm_names: frozenset, came_back: set) -> bool:
    """A restored site starts warm when every warm tensor really came back (a skipped one is
    still zero); one with none (the exact estimator: nothing carried between steps) when
    its state came back at all."""
    return warm_names <= came_back if warm_names else bool(came_back)


class _Sites(nn.ModuleDict):
    """ModuleDict that stashes checkpoint entries of sites it does not have yet."""

    def __init__(self):
        super().__init__()
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        for key, value in state_dict.items():
            if not key.startswith(prefix):
                continue
            site, _, name = key[len(prefix):].partition(".")
            if site in self._modules:
                continue
            self.pending.setdefault(site, {})[name] = value.detach().clone()
            if key in unexpected_keys:
                unexpected_keys.remove(key)


class GeoscaleState(nn.Module):
    """All sites' state of one model (``state_dict`` keys: ``sites.<site>.<tensor>``)."""

    def __init__(self):
        super().__init__()
        self.sites = _Sites()

    def forward(self, x, *args, **kwargs):
        """The identity: a container model (``nn.Sequential``) calls every child, this one
        included, and the state must not change what the model computes."""
        return x

    def get_or_create(self, key: str, specs: list[StateSpec], device) -> SiteState:
        """The state of site ``key``: one per site, whatever graph asks (prefill and decode
        share it, each reading the buffers it needs), extended with buffers it lacks."""
        if key in self.sites:
            site = self.sites[key]
            if site.fits(specs):
                site.extend(specs, torch.device(device))
                return site
            log.info("geoscale: state of %s changed shape; re-initialised", key)
        site = SiteState(specs, torch.device(device))
        site.key = key
        self.sites[key] = site
        saved = self.sites.pending.pop(key, None)
        if saved:
            site.restore(saved)
        return site

    def mark_cold(self) -> None:
        """Weights changed without their scaling state: re-initialise from them next call."""
        for site in self.sites.values():
            site.cold = True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        for key, site in self.sites.items():  # existing sites: warm iff their vectors came back
            names = {k[len(prefix) + len("sites.") + len(key) + 1:] for k in state_dict
                     if k.startswith(f"{prefix}sites.{key}.")}
            site.cold = not _warm(site.warm_names, names)
            site.calib_seen = None
