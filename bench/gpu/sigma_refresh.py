"""Check ``sigma``: the certified σ refresh at 7B shapes on the GPU, as a share of a training step.

The docs' "≤ 0.17% of a 4k-token step" is FLOP arithmetic (``python -m bench.certified_cost``);
this measures it. The bound's time: per layer, the two certified routes of
``geoscale_fx.core.spectral`` on random per-head weights of the run's shapes (the norm product
of RoPE models — Llama's default — and σ exact, float64 inside), times the layer count; and
geoscale's own refresh of the model: ``site_logit_bound`` of every site ``find_attention``
finds in the run's full-depth model, from its live weights. The step's time: forward and
backward of that model (random weights, BF16, SDPA) on one sequence of ``step_tokens`` tokens
with the LM loss; the optimizer step is left out (AdamW's states for 8B would take 64 GB
more), so the step is shorter than a real one and the share an overestimate.
"""
from __future__ import annotations

import torch

from bench.gpu.harness import CheckContext, device_seconds
from bench.gpu.models import shared_llama

__all__ = ["check_sigma", "ESTIMATES"]

#: seconds on one H200: per layer the Gram matrices (2·d·d_h²·(n_q + n_kv) ≈ 5 GFLOP in
#: float64, ~0.1 ms at 67 TFLOP/s) and 40 batched 128×128 eigen solves (launch-bound, ~ms);
#: tracing the 32-layer model ~10 s; the step 6·N·T ≈ 2·10¹⁴ FLOP ≈ 0.5 s, four of them
ESTIMATES = {"routes": 3, "model": 15, "step": 6}


def _routes(ctx: CheckContext) -> None:
    from geoscale_fx.core import spectral

    s, dev = ctx.setting.shapes, ctx.setting.device
    gen = torch.Generator(dev).manual_seed(0)
    a_q = torch.randn(s.n_q, s.d, s.d_h, generator=gen, device=dev) / s.d ** 0.5
    a_k = torch.randn(s.n_kv, s.d, s.d_h, generator=gen, device=dev) / s.d ** 0.5
    norm_product = device_seconds(lambda: (spectral.head_spectral_norms(a_q),
                                           spectral.head_spectral_norms(a_k)), dev)
    sigma = device_seconds(lambda: spectral.per_head_sigma_exact(a_q, a_k), dev)
    ctx.figure("norm product ms per layer", 1e3 * norm_product)
    ctx.figure("sigma exact ms per layer", 1e3 * sigma)


def _model_bounds(ctx: CheckContext, model) -> None:
    import geoscale_fx
    from geoscale_fx.numerics.logit_bounds import site_logit_bound

    dev = ctx.setting.device
    ids = torch.randint(3, model.config.vocab_size, (1, 16), device=dev)
    with torch.no_grad():
        sites = [s for s in geoscale_fx.find_attention(model, input_ids=ids) if s.supported]
        ctx.figure("sites bounded", len(sites))
        seconds = device_seconds(lambda: [site_logit_bound(s) for s in sites], dev, repeats=3)
    ctx.figure("geoscale site bounds ms (model)", 1e3 * seconds)


def _step(ctx: CheckContext, model) -> None:
    dev, tokens = ctx.setting.device, ctx.setting.shapes.step_tokens
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), device=dev,
                        generator=torch.Generator(dev).manual_seed(2))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None
    ctx.figure(f"fwd+bwd ms ({tokens} tokens)", 1e3 * device_seconds(step, dev, repeats=3))


def check_sigma(ctx: CheckContext) -> None:
    s = ctx.setting.shapes
    ctx.run("bound routes, one layer", ESTIMATES["routes"], lambda: _routes(ctx))
    model = ctx.run("build the model", 0, lambda: shared_llama(ctx.setting))
    if model is None:
        return
    ctx.run("geoscale's bound of every site", ESTIMATES["model"],
            lambda: _model_bounds(ctx, model))
    ctx.run("training step", ESTIMATES["step"], lambda: _step(ctx, model))
    step = ctx.figures.get(f"fwd+bwd ms ({s.step_tokens} tokens)")
    if not step:
        return
    for route in ("norm product", "sigma exact"):
        per_layer = ctx.figures.get(f"{route} ms per layer")
        if per_layer is not None:
            ctx.figure(f"{route} share of a step", s.layers * per_layer / step)
    sites = ctx.figures.get("geoscale site bounds ms (model)")
    if sites is not None:
        ctx.figure("geoscale site bounds share of a step", sites / step)
