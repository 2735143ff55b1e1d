"""Per-step observation of wrapped models, shared by the scenarios (host reads: bench only)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from geoscale_fx.core.bounds import fp8_max

__all__ = ["records", "Observation", "observe_step", "train_steps", "scale_attention_weights"]


def records(wrapped) -> list:
    return list(wrapped.geoscale.records.values())


@dataclass
class Observation:
    """One step of one wrapped model, across its attention sites."""
    loss: float
    finite: bool                 # loss and gradients finite
    overflow_sites: int          # sites whose scaled logits exceeded R_max this step
    max_scaled: float            # largest |S| / scale over sites
    max_abs: float               # largest |S|
    scale: float                 # the first site's (largest) scale
    utilization: list            # per site: max|S| / (scale · R_max)


def observe_step(wrapped, before: list[float], loss: float = float("nan"),
                 finite: bool = True) -> Observation:
    recs = records(wrapped)
    after = [float(r.state.overflow_steps) for r in recs]
    fmt = fp8_max(recs[0].plan.options.fp8_format) if recs else 448.0
    return Observation(
        loss=loss, finite=finite,
        overflow_sites=sum(int(a > b) for a, b in zip(after, before)),
        max_scaled=max((float(r.state.max_scaled.max()) for r in recs), default=0.0),
        max_abs=max((float(r.state.amax.max()) for r in recs), default=0.0),
        scale=float(recs[0].state.scale.max()) if recs else math.nan,
        utilization=[float(r.state.max_scaled.max()) / fmt for r in recs])


def overflow_totals(wrapped) -> list[float]:
    return [float(r.state.overflow_steps) for r in records(wrapped)]


def train_steps(lm, wrapped, model, opt, gen, steps: int, *, batch: int = 8, seq: int = 128,
                lr_at=None, hook=None, bar=None) -> list[Observation]:
    """``steps`` optimizer steps through ``wrapped``; one Observation per step."""
    model.train()
    out = []
    for step in range(steps):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        if hook is not None:
            hook(step)
        data = lm.batch(gen, batch, seq, "train")
        before = overflow_totals(wrapped) if records(wrapped) else []
        opt.zero_grad(set_to_none=True)
        loss = lm.loss(wrapped, data)
        loss.backward()
        finite = bool(torch.isfinite(loss)) and all(
            p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        opt.step()
        if not before:
            before = [0.0] * len(records(wrapped))
        out.append(observe_step(wrapped, before, float(loss.detach()), finite))
        if bar is not None:
            bar.update(1)
    return out


def scale_attention_weights(wrapped, model, factor: float) -> list[str]:
    """Multiply every site's query and key projection weights (and biases) by ``factor``."""
    names = set()
    for record in records(wrapped):
        for proj in (record.site.q, record.site.k):
            names.update(n for n in (proj.weight_param, proj.bias_param) if n)
    with torch.no_grad():
        for name in sorted(names):
            model.get_parameter(name).mul_(factor)
    return sorted(names)
