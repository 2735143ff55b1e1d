"""Check ``flex``: the default logit lowering — flex_attention with the FP8 ``score_mod``.

``geoscale_fx.kernels.logit_attention.fused_attention`` (what the rewrite calls for a fused
site: a causal block mask, ``S / scale`` quantized to E4M3 and back inside the score_mod,
per-head scales) compiled by the run's compiler (Inductor on CUDA), against BF16 SDPA (causal,
GQA) and plain flex_attention compiled the same way with the same block mask. The per-head
scale comes from a certified bound of these inputs, ``s · max‖q_i‖ · max‖k_j‖ / (η·R_max)``
(Cauchy–Schwarz; η = 0.8, the library's default) — the weights' bound is another row's subject.

Pieces, at (batch 1, the longest length) and (the largest batch, the shortest length):
forward time and peak memory of the three (the first call's time too: the compile); at the
first shape the outputs' error against float32 attention; forward+backward time and peak
memory, and at the first shape the gradients' error (dq, dk against float32 attention's): the
score_mod quantizes ``S/scale`` with the explicit lowering's straight-through gradient
(``fp8.fake_quantize_logits``), so dq and dk are those of attention at the quantized point,
never rounded to FP8 nor zeroed where the cast saturates. On the CPU
rehearsal flex_attention has no backward ("FlexAttention does not support backward on CPU"):
the FP8 forward+backward there is the explicit lowering geoscale takes for CPU training.

Last, the user's path: a one-layer Llama of the run's shapes converted with the defaults
(``wrap(model)``: Inductor, lowering "auto", fused on CUDA) runs training steps; the first
step's time (Dynamo, geoscale, Inductor), a step's time, and ``report()``'s sites fused,
overflow steps and certified sites.
"""
from __future__ import annotations

import time

import torch

from bench.gpu.harness import CheckContext, device_seconds, peak_bytes
from bench.gpu.models import attention_inputs, bf16_sdpa, build_llama, float32_attention

__all__ = ["check_flex", "ESTIMATES"]

ETA, R_MAX = 0.8, 448.0
#: seconds on one H200: a flex forward compile ~10 s (Triton), a forward+backward one ~25 s;
#: the largest call, B=8, L=2048 or B=1, L=8192 forward: 2·B·H·L²·d_h·(1/2 causal) ≈ 1.1
#: TFLOP, ~5 ms (flex runs at roughly half of SDPA's rate): timings are a few seconds a shape
#: the model step: Dynamo, geoscale's analysis and rewrite, Inductor on a one-layer Llama's
#: training graph with flex forward and backward ~60 s; the steps themselves well under 1 s
ESTIMATES = {"forward": 25, "forward+backward": 55, "model training step": 60}


def _divisor(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``(H_q,)`` float32: a certified bound on ``|S|`` per query head over (η·R_max)."""
    group = q.shape[1] // k.shape[1]
    q_max = q.detach().float().norm(dim=-1).amax(dim=(0, 2))                     # (H_q,)
    k_max = k.detach().float().norm(dim=-1).amax(dim=(0, 2)).repeat_interleave(group)
    return (scale * q_max * k_max / (ETA * R_MAX)).clamp_min(1e-12)


def _variants(setting, scale: float, backward: bool) -> dict:
    """name -> callable(q, k, v, divisor) for the three attentions of a shape."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from geoscale_fx.kernels.logit_attention import explicit_attention, fused_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def plain_flex(q, k, v, divisor):
        mask = create_block_mask(causal, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)

    def fp8_flex(q, k, v, divisor):
        return fused_attention(q, k, v, None, divisor, softmax_scale=scale, is_causal=True,
                               enable_gqa=True, fmt="e4m3")

    def fp8_explicit(q, k, v, divisor):
        return explicit_attention(q, k, v, None, softmax_scale=scale, is_causal=True,
                                  enable_gqa=True, dropout_p=0.0, fmt="e4m3",
                                  divisor_of=lambda logits: divisor)

    def sdpa(q, k, v, divisor):
        return bf16_sdpa(q, k, v, scale)

    def compiled(fn):
        return torch.compile(fn, backend=setting.compiler, dynamic=False, fullgraph=True)
    if backward and not setting.cuda:
        return {"SDPA bf16": sdpa, "FP8 explicit": compiled(fp8_explicit)}
    return {"SDPA bf16": sdpa, "plain flex": compiled(plain_flex), "FP8 flex": compiled(fp8_flex)}


def _forward(ctx: CheckContext, batch: int, length: int, scale: float, errors: bool) -> None:
    dev, tag = ctx.setting.device, f"b{batch} l{length}"
    torch._dynamo.reset()
    q, k, v = attention_inputs(ctx.setting, batch, length)
    divisor = _divisor(q, k, scale)
    outputs = {}
    with torch.no_grad():
        for name, fn in _variants(ctx.setting, scale, backward=False).items():
            began = time.perf_counter()
            outputs[name] = fn(q, k, v, divisor)
            if dev == "cuda":
                torch.cuda.synchronize()
            if name != "SDPA bf16":
                ctx.figure(f"{name} first call s {tag}", time.perf_counter() - began)
            ctx.figure(f"{name} fwd ms {tag}",
                       1e3 * device_seconds(lambda: fn(q, k, v, divisor), dev))
            memory = peak_bytes(lambda: fn(q, k, v, divisor), dev)
            if memory is not None:
                ctx.figure(f"{name} fwd peak MiB {tag}", memory / 2 ** 20)
        if errors:
            ref = float32_attention(q, k, v, scale)
            for name, out in outputs.items():
                ctx.figure(f"{name} rel L2 vs fp32 {tag}",
                           (out.float() - ref).norm() / ref.norm())
    fp8, plain = ctx.figures[f"FP8 flex fwd ms {tag}"], ctx.figures[f"plain flex fwd ms {tag}"]
    ctx.figure(f"FP8 flex / plain flex fwd {tag}", fp8 / plain)
    ctx.figure(f"FP8 flex / SDPA fwd {tag}", fp8 / ctx.figures[f"SDPA bf16 fwd ms {tag}"])


def _reference_grads(q, k, v, grad, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` of float32 attention on float32 copies of the inputs."""
    qf, kf, vf = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    float32_attention(qf, kf, vf, scale).backward(grad.float())
    return qf.grad, kf.grad


def _forward_backward(ctx: CheckContext, batch: int, length: int, scale: float,
                      errors: bool) -> None:
    dev, tag = ctx.setting.device, f"b{batch} l{length}"
    torch._dynamo.reset()
    q, k, v = attention_inputs(ctx.setting, batch, length, requires_grad=True)
    divisor = _divisor(q, k, scale)
    grad = torch.randn_like(q)
    reference = _reference_grads(q, k, v, grad, scale) if errors else None
    for name, fn in _variants(ctx.setting, scale, backward=True).items():
        def step():
            fn(q, k, v, divisor).backward(grad)
            q.grad = k.grad = v.grad = None
        began = time.perf_counter()
        fn(q, k, v, divisor).backward(grad)
        if dev == "cuda":
            torch.cuda.synchronize()
        if name != "SDPA bf16":
            ctx.figure(f"{name} first fwd+bwd s {tag}", time.perf_counter() - began)
        if reference is not None:      # the gradients the scores' quantizer lets through
            for label, got, ref in (("dq", q.grad, reference[0]), ("dk", k.grad, reference[1])):
                ctx.figure(f"{name} {label} rel L2 vs fp32 {tag}",
                           (got.float() - ref).norm() / ref.norm())
        q.grad = k.grad = v.grad = None
        ctx.figure(f"{name} fwd+bwd ms {tag}", 1e3 * device_seconds(step, dev))
        memory = peak_bytes(step, dev)
        if memory is not None:
            ctx.figure(f"{name} fwd+bwd peak MiB {tag}", memory / 2 ** 20)
    fp8 = ctx.figures.get(f"FP8 flex fwd+bwd ms {tag}")
    if fp8 is not None:
        ctx.figure(f"FP8 flex / plain flex fwd+bwd {tag}",
                   fp8 / ctx.figures[f"plain flex fwd+bwd ms {tag}"])
        ctx.figure(f"FP8 flex / SDPA fwd+bwd {tag}",
                   fp8 / ctx.figures[f"SDPA bf16 fwd+bwd ms {tag}"])


def _model_step(ctx: CheckContext) -> None:
    """A one-layer Llama of the run's shapes converted with the defaults (``wrap(model,
    compiler=<the run's>)``, lowering "auto"): training steps on one sequence of the first
    length; its first step compiles. What ``report()`` says of its site afterwards."""
    import geoscale_fx

    dev, length = ctx.setting.device, ctx.setting.shapes.lengths[0]
    torch._dynamo.reset()
    model = build_llama(ctx.setting, layers=1, vocab=1024)
    ids = torch.randint(3, 1024, (1, length), device=dev,
                        generator=torch.Generator(dev).manual_seed(3))
    wrapped = geoscale_fx.wrap(model, compiler=ctx.setting.compiler)

    def step():
        wrapped(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None
    began = time.perf_counter()
    step()
    if dev == "cuda":
        torch.cuda.synchronize()
    ctx.figure(f"model first step s l{length}", time.perf_counter() - began)
    ctx.figure(f"model step ms l{length}", 1e3 * device_seconds(step, dev, repeats=3))
    rows = wrapped.report().rows
    ctx.note("model lowering: " + ", ".join(sorted({str(r["lowering"]) for r in rows})))
    ctx.figure("model sites fused", sum("fused" in str(r["lowering"]) for r in rows))
    ctx.figure("model overflow steps", sum(r["overflow_steps"] or 0 for r in rows))
    ctx.figure("model sites certified", sum(bool(r["certified"]) for r in rows))


def check_flex(ctx: CheckContext) -> None:
    s = ctx.setting.shapes
    scale = s.d_h ** -0.5
    shapes = list(dict.fromkeys([(s.batches[0], s.lengths[-1]), (s.batches[-1], s.lengths[0])]))
    for i, (batch, length) in enumerate(shapes):
        ctx.run(f"forward b{batch} l{length}", ESTIMATES["forward"] / 2,
                lambda: _forward(ctx, batch, length, scale, errors=i == 0))
    if not ctx.setting.cuda:
        ctx.note("CPU rehearsal: flex_attention has no CPU backward; forward+backward times "
                 "the FP8 explicit lowering (what geoscale trains with on a CPU)")
    for i, (batch, length) in enumerate(shapes):
        ctx.run(f"forward+backward b{batch} l{length}", ESTIMATES["forward+backward"] / 2,
                lambda: _forward_backward(ctx, batch, length, scale, errors=i == 0))
    ctx.run("model training step", ESTIMATES["model training step"], lambda: _model_step(ctx))
