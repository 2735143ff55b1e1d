"""``geoscale_fx.calibrate(model, batches)``: auto-α on a data loader, before training.

Runs the paper's Algorithm 5 burn-in over ``batches`` (forward only, no gradients) and freezes
``α_final = quantile_q({r_t}) · κ`` per site (per head), ``r_t = max|S| / B_max``. Returns the
wrapped model, already predictive: the next forward passes use the fused path and no longer
materialize the scores. The calibrated α is in ``model.state_dict()``.

    >>> fp8 = geoscale_fx.calibrate(model, loader, quantile=0.9999, kappa=1.0)  # doctest: +SKIP
    >>> loss = fp8(**batch).loss                                                # doctest: +SKIP
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from geoscale_fx.api.wrapper import GeoscaleModule, wrap

__all__ = ["calibrate"]

log = logging.getLogger("geoscale_fx")


def _call(model: nn.Module, batch: Any):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _calibrated(wrapped: GeoscaleModule) -> bool:
    records = wrapped.geoscale.records.values()
    return bool(records) and all(bool(r.state.calibrated) for r in records)


def calibrate(model: nn.Module, batches: Iterable[Any], *, progress: bool = True,
              **options) -> GeoscaleModule:
    """Calibrate auto-α on ``batches`` (dicts of kwargs, tuples of args, or single tensors).

    ``calib_steps`` defaults to the number of batches (when ``batches`` has a length). With
    fewer batches than ``calib_steps``, α is frozen from the ratios collected (and a warning
    says so). ``model`` may be an already wrapped model with ``alpha="auto"``.
    """
    total = len(batches) if hasattr(batches, "__len__") else None
    if isinstance(model, GeoscaleModule):
        if options:
            raise ValueError("calibrate: options are fixed when the model is already wrapped; "
                             f"got {sorted(options)}")
        wrapped = model
    else:
        if options.setdefault("alpha", "auto") != "auto":
            raise ValueError(f"calibrate needs alpha='auto', got alpha={options['alpha']!r}")
        options.setdefault("calib_steps", total or 100)
        wrapped = wrap(model, **options)
    if wrapped.geoscale.options.alpha != "auto":
        raise ValueError("calibrate needs a model wrapped with alpha='auto'")
    steps = wrapped.geoscale.options.calib_steps
    bar = tqdm(total=min(steps, total) if total else steps, desc="geoscale auto-alpha",
               unit="batch", disable=not progress)
    seen = 0
    with torch.no_grad():
        for batch in batches:
            if _calibrated(wrapped):
                break
            _call(wrapped, batch)
            seen += 1
            bar.update(1)
    bar.close()
    if not _calibrated(wrapped):
        log.warning("geoscale: %d calibration batches for calib_steps=%d; alpha frozen from "
                    "the ratios collected so far", seen, steps)
        wrapped.geoscale.finalize_calibration()
    return wrapped
