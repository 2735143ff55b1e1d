"""Check ``fp8_qkv``: FlashAttention-3's FP8 kernel behind ``lowering="fp8_qkv"``.

Pieces, in order (H200 estimates from bandwidth and FLOPs: ``ESTIMATES``):

* **emulation vs float32**: ``emulated_fp8_attention`` (FA3's FP8 semantics in FP32) against
  float32 attention at batch 1 and the first length, descales ``amax / R_max`` per kv head:
  the error FP8 q/k/v cost.
* **this device vs the CPU** (CUDA only): the same emulation on the GPU and on the CPU, the
  same inputs: the GPU path computes the CPU path's semantics.
* **speed**, over the batch × length grid: BF16 SDPA (causal, GQA, torch's default flash
  kernel) and the emulation where its L×L scores fit.
* **FA3 activation**: ``activate_flash_attention_impl("FA3")`` (torch 2.11+ ships the registry
  and ``_scaled_dot_product_attention_quantized``; the kernels come from the flash-attn-3
  package, module ``flash_attn_interface``, built for compute capability 9.0). Then the kernel
  (``fa3_fp8_attention``) against the emulation (max error, relative L2) and **FA3 speed** over
  the grid: FA3 FP8 with the lowering's casts, the kernel alone on operands cast beforehand,
  BF16 SDPA on FA3, and BF16 SDPA (default kernel) over FA3 FP8.
* **certified descales**: a one-layer Llama of the run's shapes wrapped with
  ``lowering="fp8_qkv"`` (compiler ``eager``: the check is the descales, not the compile; FA3
  active if it could be), one forward of the first length: ``report()``'s overflow steps (0
  expected), the largest ``|x|/δ`` over R_max, the sites on FA3, the logits' error against the
  unwrapped model.

torch's default flash implementation is restored at the end (the later checks time it).
"""
from __future__ import annotations

import itertools

import torch

from bench.gpu.harness import CheckContext, NO_CUDA, device_seconds
from bench.gpu.models import attention_inputs, bf16_sdpa, build_llama, float32_attention

__all__ = ["check_fp8_qkv", "ESTIMATES"]

R_MAX = 448.0
#: seconds on one H200. Emulation at B=1, L=2048, 32 heads: ~10 float32 passes over
#: 32·2048² scores (0.5 GB each) plus 2·34 GFLOP: < 0.1 s a call, a few calls; the CPU copy of
#: it on 16 cores ~3 s; FA3 activation ~1 s (an import); the one-layer model: building ~2 s,
#: Dynamo capture and analysis ~10 s, one forward; the speed grid: SDPA at B=8, L=8192 is
#: 2·B·H·L²·d_h = 4.4 TFLOP causal, ~10 ms at ~450 TFLOP/s, 4 shapes × 3 variants × 6 calls
ESTIMATES = {"emulation vs float32": 2, "this device vs the CPU": 5, "FA3 activation": 2,
             "FA3 kernel vs emulation": 2, "certified descales": 20, "speed": 10}
#: the largest L×L score tensor (bytes, float32) the emulation's timing may materialize
EMULATION_BYTES = 4 << 30


def _amax_descales(q, k, v, n_kv: int):
    """``(H_kv,)`` float32 descales ``amax / R_max`` per kv head (q: over its group)."""
    def per_kv(x):
        amax = x.detach().abs().float().amax(dim=(0, 2, 3))               # (H,)
        return (amax.reshape(n_kv, -1).amax(dim=-1) / R_MAX).clamp_min(1e-12)
    return per_kv(q), per_kv(k), per_kv(v)


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - ref.float())
    return float(diff.abs().max()), float(diff.norm() / ref.float().norm())


def _emulation_pieces(ctx: CheckContext, kernels, scale: float) -> None:
    s, dev = ctx.setting.shapes, ctx.setting.device
    q, k, v = attention_inputs(ctx.setting, 1, s.lengths[0])
    descales = _amax_descales(q, k, v, s.n_kv)

    def emulated(q, k, v, descales):
        return kernels.emulated_fp8_attention(q, k, v, *descales, softmax_scale=scale,
                                              is_causal=True)

    def vs_float32():
        worst, rel = _errors(emulated(q, k, v, descales), float32_attention(q, k, v, scale))
        ctx.figure("emulation max err vs fp32", worst)
        ctx.figure("emulation rel L2 vs fp32", rel)
    ctx.run("emulation vs float32", ESTIMATES["emulation vs float32"], vs_float32)
    if not ctx.setting.cuda:
        ctx.skip("this device vs the CPU", "not run: the run is on the CPU")
        return

    def vs_cpu():
        here = emulated(q, k, v, descales).float().cpu()
        there = emulated(*(x.cpu() for x in (q, k, v)), tuple(d.cpu() for d in descales))
        worst, rel = _errors(here, there)
        ctx.figure("emulation cuda vs cpu max diff", worst)
        ctx.figure("emulation cuda vs cpu rel L2", rel)
    ctx.run("this device vs the CPU", ESTIMATES["this device vs the CPU"], vs_cpu)


def _activate_fa3(kernels) -> str:
    """"" when FA3 is active, else why not."""
    from torch.nn import attention

    if not hasattr(attention, "activate_flash_attention_impl"):
        return (f"torch {torch.__version__} has no activate_flash_attention_impl "
                "(torch's FA3 registry comes with 2.11)")
    try:
        attention.activate_flash_attention_impl("FA3")
    except Exception as exc:
        return (f"activate_flash_attention_impl('FA3') failed: {type(exc).__name__}: {exc} "
                "(torch's FA3 kernels come from the flash-attn-3 package, module "
                "flash_attn_interface, built for compute capability 9.0)")
    return "" if kernels.fa3_available("cuda") else "FA3 activated but fa3_available is False"


def _fa3_pieces(ctx: CheckContext, kernels, scale: float) -> bool:
    if not ctx.setting.cuda:
        ctx.skip("FA3 activation", NO_CUDA)
        ctx.skip("FA3 kernel vs emulation", NO_CUDA)
        return False
    why = ctx.run("FA3 activation", ESTIMATES["FA3 activation"], lambda: _activate_fa3(kernels))
    if why:
        ctx.note(f"FA3: {why}")
        ctx.skip("FA3 kernel vs emulation", f"not run: {why}")
        return False
    if why is None:
        return False
    s = ctx.setting.shapes
    q, k, v = attention_inputs(ctx.setting, 1, s.lengths[0])
    descales = _amax_descales(q, k, v, s.n_kv)

    def kernel_vs_emulation():
        call = dict(softmax_scale=scale, is_causal=True)
        kernel = kernels.fa3_fp8_attention(q, k, v, *descales, **call)
        emulated = kernels.emulated_fp8_attention(q, k, v, *descales, **call)
        worst, rel = _errors(kernel, emulated)
        ctx.figure("FA3 vs emulation max err", worst)
        ctx.figure("FA3 vs emulation rel L2", rel)
        ctx.figure("FA3 rel L2 vs fp32", _errors(kernel, float32_attention(q, k, v, scale))[1])
    ctx.run("FA3 kernel vs emulation", ESTIMATES["FA3 kernel vs emulation"],
            kernel_vs_emulation)
    return True


def _certified_descales(ctx: CheckContext) -> None:
    import geoscale_fx

    s = ctx.setting.shapes
    model = build_llama(ctx.setting, layers=1, vocab=1024)
    ids = torch.randint(3, 1024, (1, s.lengths[0]), device=ctx.setting.device,
                        generator=torch.Generator(ctx.setting.device).manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        wrapped = geoscale_fx.wrap(model, lowering="fp8_qkv", compiler="eager")
        logits = wrapped(input_ids=ids).logits
    rows = wrapped.report().rows
    ctx.note("lowerings taken: " + ", ".join(sorted({str(r["lowering"]) for r in rows})))
    ctx.figure("sites fp8_qkv", sum(str(r["lowering"]).startswith("fp8_qkv") for r in rows))
    ctx.figure("sites on FA3", sum("fa3" in str(r["lowering"]) for r in rows))
    ctx.figure("overflow steps", sum(r["overflow_steps"] or 0 for r in rows))
    ctx.figure("max |x|/delta / R_max", max(r["utilization"] or 0.0 for r in rows))
    ctx.figure("logits rel L2 vs unwrapped", _errors(logits, plain)[1])


def _grid(ctx: CheckContext):
    s = ctx.setting.shapes
    for batch, length in itertools.product(s.batches, s.lengths):
        yield batch, length, f"b{batch} l{length}"


def _speed_default(ctx: CheckContext, kernels, scale: float) -> None:
    """BF16 SDPA with torch's default flash implementation, and the emulation where its
    scores fit."""
    s, dev = ctx.setting.shapes, ctx.setting.device
    for batch, length, tag in _grid(ctx):
        def one_shape():
            q, k, v = attention_inputs(ctx.setting, batch, length)
            sdpa = device_seconds(lambda: bf16_sdpa(q, k, v, scale), dev)
            ctx.figure(f"SDPA bf16 ms {tag}", 1e3 * sdpa)
            if batch * s.n_q * length ** 2 * 4 <= EMULATION_BYTES:
                descales = _amax_descales(q, k, v, s.n_kv)
                emulated = device_seconds(lambda: kernels.emulated_fp8_attention(
                    q, k, v, *descales, softmax_scale=scale, is_causal=True), dev, repeats=3)
                ctx.figure(f"emulation ms {tag}", 1e3 * emulated)
        ctx.run(f"speed {tag}", ESTIMATES["speed"] / 8, one_shape)


def _raw_kernel(q, k, v, descales, scale: float):
    """The FA3 FP8 call alone on operands cast beforehand: ``() -> out``."""
    from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
        _scaled_dot_product_attention_quantized,
    )

    group = q.shape[1] // k.shape[1]
    dq, dk, dv = descales
    cast = [(x.float() / d.repeat_interleave(r)[None, :, None, None]).to(torch.float8_e4m3fn)
            for x, d, r in ((q, dq, group), (k, dk, 1), (v, dv, 1))]
    kernel_descales = [d.reshape(1, -1).expand(q.shape[0], -1).contiguous() for d in descales]
    return lambda: _scaled_dot_product_attention_quantized(
        *cast, is_causal=True, scale=scale, q_descale=kernel_descales[0],
        k_descale=kernel_descales[1], v_descale=kernel_descales[2])


def _speed_fa3(ctx: CheckContext, kernels, scale: float) -> None:
    """FA3 FP8 (with the lowering's casts, and the kernel alone), and BF16 SDPA with FA3 as
    torch's flash implementation, against BF16 SDPA with the default one."""
    s, dev = ctx.setting.shapes, ctx.setting.device
    for batch, length, tag in _grid(ctx):
        def one_shape():
            q, k, v = attention_inputs(ctx.setting, batch, length)
            descales = _amax_descales(q, k, v, s.n_kv)
            fp8 = device_seconds(lambda: kernels.fa3_fp8_attention(
                q, k, v, *descales, softmax_scale=scale, is_causal=True), dev)
            raw = device_seconds(_raw_kernel(q, k, v, descales, scale), dev)
            bf16 = device_seconds(lambda: bf16_sdpa(q, k, v, scale), dev)
            ctx.figure(f"FA3 fp8 ms {tag}", 1e3 * fp8)
            ctx.figure(f"FA3 fp8 kernel alone ms {tag}", 1e3 * raw)
            ctx.figure(f"SDPA bf16 on FA3 ms {tag}", 1e3 * bf16)
            default = ctx.figures.get(f"SDPA bf16 ms {tag}")
            if default is not None:
                ctx.figure(f"SDPA bf16 / FA3 fp8 {tag}", default / fp8)
        ctx.run(f"FA3 speed {tag}", ESTIMATES["speed"] / 8, one_shape)


def check_fp8_qkv(ctx: CheckContext) -> None:
    from geoscale_fx.kernels import qkv_attention as kernels

    scale = ctx.setting.shapes.d_h ** -0.5
    _emulation_pieces(ctx, kernels, scale)
    _speed_default(ctx, kernels, scale)
    try:
        if _fa3_pieces(ctx, kernels, scale):
            _speed_fa3(ctx, kernels, scale)
        ctx.run("certified descales", ESTIMATES["certified descales"],
                lambda: _certified_descales(ctx))
    finally:   # the later checks time torch's default flash implementation
        if ctx.setting.cuda:
            from torch.nn import attention

            if hasattr(attention, "restore_flash_attention_impl"):
                attention.restore_flash_attention_impl()
