"""The checks of ``python -m bench.gpu``, in the order they run, with their limits.

Each limit is the check's share of the whole run's budget (≤ 8 minutes on one H200 with the
start-up); its estimate is the sum of its pieces' (each module's ``ESTIMATES`` says how they
were derived). The checks that share the full-depth model (kv_cache, sigma, export) run one
after the other, and the model is built once.
"""
from __future__ import annotations

from bench.gpu import export_scales, flex_logits, fp8_qkv, kv_cache, sigma_refresh, suite_tests
from bench.gpu.harness import Check

__all__ = ["CHECKS", "BUDGET_S"]

#: the checks' budget: 8 minutes less ~35 s for the interpreter, torch and CUDA to start
BUDGET_S = 445.0

CHECKS = (
    Check("suite", "the suite's CUDA tests (skipif-guarded), pass/fail counts",
          "The tests written for CUDA and skipped everywhere else run where they were meant "
          "to: today the FA3 kernel against the emulation (tests/test_fp8_qkv.py).",
          suite_tests.check_suite, limit_s=35, estimate_s=25),
    Check("fp8_qkv", 'lowering="fp8_qkv" on FlashAttention-3\'s FP8 kernel',
          "FA3's FP8 forward computes what the emulation (the CPU path) computes — max error "
          "and relative L2 of kernel against emulation —; the descales bounded from a "
          "Llama-3-8B layer's weights never saturate (0 overflow steps); its forward speed "
          "against BF16 SDPA. Without FA3 (the flash-attn-3 package) the row says why, and "
          "the emulation on the GPU is still checked against the CPU's.",
          fp8_qkv.check_fp8_qkv, limit_s=70, estimate_s=sum(fp8_qkv.ESTIMATES.values())),
    Check("flex", "the default logit lowering: flex_attention + FP8 score_mod, Inductor",
          "The fused FP8-logit attention compiles for the GPU and runs forward and backward; "
          "what the FP8 logits cost in time and peak memory against BF16 SDPA and plain "
          "flex_attention, and in output and gradient error against float32; a model "
          "converted with the defaults trains on the GPU with its sites fused.",
          flex_logits.check_flex, limit_s=170, estimate_s=sum(flex_logits.ESTIMATES.values())),
    Check("kv_cache", 'generate with kv_cache="fp8" against a BF16 cache',
          "geoscale's FP8 KV cache (scales from the weights) on the GPU: decode tokens/s and "
          "cache bytes against BF16, 0 saturated entries, teacher-forced top-1 agreement.",
          kv_cache.check_kv_cache, limit_s=80,
          estimate_s=kv_cache.ESTIMATES["build"] + 4 * kv_cache.ESTIMATES["shape"]),
    Check("sigma", "the certified σ refresh at 7B shapes, as a share of a 4k-token step",
          "The per-step cost of a certified bound, measured on the GPU (the docs' ≤ 0.17% is "
          "FLOP arithmetic).",
          sigma_refresh.check_sigma, limit_s=40,
          estimate_s=sum(sigma_refresh.ESTIMATES.values())),
    Check("export", "export_kv_scales and attention_scales of an 8B-shaped model",
          "The serving scales come out of a model on the GPU, every one finite and positive, "
          "the export equal to attention_scales, and what each costs (an RL loop's refresh).",
          export_scales.check_export, limit_s=50,
          estimate_s=sum(export_scales.ESTIMATES.values())),
)
