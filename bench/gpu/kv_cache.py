"""Check ``kv_cache``: ``generate`` with geoscale's FP8 KV cache against a BF16 cache.

The run's full-depth random-weight model (``models.shared_llama``) generates ``new_tokens``
greedy tokens after a random prompt with transformers' ``DynamicCache`` in BF16; then the same
tokens are forced through ``generate`` with the cache of ``kv_cache="fp8"``
(``KVCacheManager(model, "fp8").new_cache``: E4M3 entries, per-kv-head scales bounded from
the weights) — the model itself uncompiled, so the figures are the cache's. Per batch ×
prompt length: decode tokens/s of both (the batch over the median time between two generated
tokens, read by a logits processor that synchronizes the device), the cache's bytes against
BF16's, saturated cache entries (0 expected), and the teacher-forced agreement of the FP8
run's logits with the BF16 run's (top-1, relative L2; ``bench.quality.logit_metrics``).
Random weights: the agreement is that of a random model's near-flat logits, a lower bar than
a trained model's.
"""
from __future__ import annotations

import time

import torch

from bench.gpu.harness import CheckContext
from bench.gpu.models import shared_llama

__all__ = ["check_kv_cache", "ESTIMATES"]

#: seconds on one H200: the 8B model built on the GPU ~10 s; a decode step of 8B in eager
#: transformers ~25 ms (launch-bound; weights read at 4.8 TB/s: 3.5 ms), prefill of 8×2048
#: tokens ≈ 260 TFLOP ~0.6 s, of 8×8192 ~3 s; two generates of 32 tokens per shape
ESTIMATES = {"build": 10, "shape": 12}


def _processors(forced: torch.Tensor | None, clock: list, device: str):
    """Logits processors: teacher forcing along ``forced`` (if given), then a clock that
    records the time of every call — one per generated token, so successive calls are one
    decode step apart."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = torch.full_like(scores, -float("inf"))
            return out.scatter_(1, forced[:, input_ids.shape[1], None], 0.0)

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if device == "cuda":
                torch.cuda.synchronize()
            clock.append(time.perf_counter())
            return scores
    return LogitsProcessorList(([Forced()] if forced is not None else []) + [Clock()])


def _generate(model, prompt, new: int, cache, forced=None, clock=None):
    """Greedy ``generate`` of ``new`` tokens (forced along ``forced``), its raw logits."""
    from geoscale_fx.kv_cache.manager import cache_argument

    clock = [] if clock is None else clock
    extra = {cache_argument(): cache} if cache is not None else {}
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              logits_processor=_processors(forced, clock, prompt.device.type),
                              **extra)


def _decode_rate(batch: int, clock: list) -> float:
    """Tokens/s of the decode steps: the batch over the median time between steps."""
    steps = sorted(b - a for a, b in zip(clock, clock[1:]))
    return batch / steps[len(steps) // 2]


def _shape(ctx: CheckContext, model, manager, batch: int, length: int) -> None:
    from bench.quality import logit_metrics
    from geoscale_fx.kv_cache.layers import cache_nbytes
    from transformers import DynamicCache

    dev, new, tag = ctx.setting.device, ctx.setting.shapes.new_tokens, f"b{batch} l{length}"
    prompt = torch.randint(3, model.config.vocab_size, (batch, length), device=dev,
                           generator=torch.Generator(dev).manual_seed(length + batch))
    _generate(model, prompt[:, :16], 2, None)                         # warm-up
    bf16_clock, bf16_cache = [], DynamicCache(config=model.config)
    reference = _generate(model, prompt, new, bf16_cache, clock=bf16_clock)
    fp8_clock, fp8_cache = [], manager.new_cache(prompt)
    forced = _generate(model, prompt, new, fp8_cache, forced=reference.sequences,
                       clock=fp8_clock)
    bf16_rate, fp8_rate = _decode_rate(batch, bf16_clock), _decode_rate(batch, fp8_clock)
    ctx.figure(f"bf16 decode tok/s {tag}", bf16_rate)
    ctx.figure(f"fp8 decode tok/s {tag}", fp8_rate)
    ctx.figure(f"fp8 / bf16 tok/s {tag}", fp8_rate / bf16_rate)
    ctx.figure(f"fp8 cache MiB {tag}", cache_nbytes(fp8_cache) / 2 ** 20)
    ctx.figure(f"fp8 / bf16 cache bytes {tag}",
               cache_nbytes(fp8_cache) / cache_nbytes(bf16_cache))
    metrics = logit_metrics(torch.stack(reference.logits).float(),
                            torch.stack(forced.logits).float())
    ctx.figure(f"teacher-forced top-1 {tag}", metrics["top1"])
    ctx.figure(f"teacher-forced rel L2 {tag}", metrics["rel_l2"])
    ctx.figure("saturated FP8 cache entries (so far)", manager.saturated_total())


def check_kv_cache(ctx: CheckContext) -> None:
    import itertools

    from geoscale_fx.kv_cache.manager import KVCacheManager

    model = ctx.run("build the model", ESTIMATES["build"], lambda: shared_llama(ctx.setting))
    if model is None:
        return
    manager = KVCacheManager(model, "fp8")
    s = ctx.setting.shapes
    for length, batch in itertools.product(s.lengths, s.batches):
        ctx.run(f"generate b{batch} l{length}", ESTIMATES["shape"],
                lambda: _shape(ctx, model, manager, batch, length))
