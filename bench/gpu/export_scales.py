"""Check ``export``: ``attention_scales`` and ``export_kv_scales`` of an 8B-shaped model on the GPU.

On the run's full-depth random-weight model, on the device: ``attention_scales(model, ids)``
— its first call (one trace, then the bounds), a call after every parameter's version was
bumped (as after an optimizer step: the bounds recomputed from all the weights; an RL loop's
cost per weight sync) and a call with nothing changed (read back) —, then
``export_kv_scales(model, dir, ids)`` (its own trace, the bounds, the compressed-tensors files
written). Also: how many scales, whether every one is finite and positive, and whether the
export wrote the very tensors ``attention_scales`` returned (the docs say bit for bit).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.gpu.harness import CheckContext, device_seconds
from bench.gpu.models import shared_llama

__all__ = ["check_export", "ESTIMATES"]

#: seconds on one H200: a Dynamo trace of the 32-layer model ~10 s (3 s measured on a CPU,
#: ``python -m bench.analysis``), the bounds from 32 layers' q/k/v weights (~0.2 GB of BF16
#: read, float64 Gram matrices) well under a second; the export traces again
ESTIMATES = {"first call": 15, "refresh": 3, "export": 15}


def _ids(ctx: CheckContext, model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, 16), device=ctx.setting.device)


def _first_call(ctx: CheckContext, model) -> dict:
    import geoscale_fx

    began = time.perf_counter()
    scales = geoscale_fx.attention_scales(model, _ids(ctx, model))
    ctx.figure("attention_scales first call s", time.perf_counter() - began)
    ctx.figure("scales", len(scales))
    ctx.figure("scales finite and > 0", sum(bool(torch.isfinite(t).all() and (t > 0).all())
                                            for t in scales.values()))
    return scales


def _refresh(ctx: CheckContext, model) -> None:
    import geoscale_fx

    params, dev = list(model.parameters()), ctx.setting.device

    def changed():
        torch.autograd.graph.increment_version(params)        # as after optimizer.step()
        return geoscale_fx.attention_scales(model)
    ctx.figure("attention_scales after a weight change ms", 1e3 * device_seconds(changed, dev))
    ctx.figure("attention_scales unchanged ms", 1e3 * device_seconds(
        lambda: geoscale_fx.attention_scales(model), dev))


def _export(ctx: CheckContext, model, scales: dict | None) -> None:
    import geoscale_fx

    out_dir = Path(ctx.setting.scratch) / "export-kv-scales"
    began = time.perf_counter()
    written = geoscale_fx.export_kv_scales(model, out_dir, _ids(ctx, model))
    ctx.figure("export_kv_scales s", time.perf_counter() - began)
    ctx.figure("files written", len(written.files))
    if scales is not None:
        same = [torch.equal(written.tensors[name].cpu(), scales[name].cpu())
                for name in scales if name in written.tensors]
        ctx.figure("exported == attention_scales", sum(same))


def check_export(ctx: CheckContext) -> None:
    model = ctx.run("build the model", 0, lambda: shared_llama(ctx.setting))
    if model is None:
        return
    scales = ctx.run("attention_scales, first call", ESTIMATES["first call"],
                     lambda: _first_call(ctx, model))
    if scales is not None:
        ctx.run("attention_scales, refresh", ESTIMATES["refresh"], lambda: _refresh(ctx, model))
    ctx.run("export_kv_scales", ESTIMATES["export"], lambda: _export(ctx, model, scales))
