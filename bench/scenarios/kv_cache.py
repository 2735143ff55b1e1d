"""Scenario 12: an FP8 KV cache, with k/v scales from four sources (issue 12).

Per pretrained causal LM: a prompt of real text, then greedy decoding with a Hugging Face
``DynamicCache`` whose layers store E4M3 (``geoscale_fx.kv_cache.layers``), the scales from

* (a) geometry — the certified per-kv-head bounds from the weights (``WeightKVScales``);
* (b) unit — the engines' default ``k_scale = v_scale = 1.0``;
* (c) first batch — vLLM's ``calculate_kv_scales``: ``amax(k) / 200`` and ``amax(v) / 100``
  per layer (``K_SCALE_CONSTANT``/``V_SCALE_CONSTANT`` of ``vllm/envs.py``) on the first
  batch it serves (here: a calibration batch of other text, then frozen);
* (d) ideal — per step and per head, each new token's keys/values quantized with their own
  max (an oracle: no engine knows the max before writing; scales kept per step).

Measured against the unquantized model, over ``SEEDS`` prompts (median and range): cache
bytes; teacher-forced decoding of the unquantized model's own greedy tokens, one token per
call through the FP8 cache, compared with the unquantized logits at the generated positions
(``bench.quality.logit_metrics``: relative L2, KL(unquantized ‖ FP8) per token, top-1
agreement — the error of the cache, not of divergence); the first token where free-running
greedy decoding with the FP8 cache differs from the unquantized model's, per sequence;
saturated cache entries (|x / scale| ≥ R_max, clamped) and the largest |x / scale| / R_max.
Then the same after a fine-tuning phase that changes the weights (AdamW on training text):
geometry re-derives its scales from the new weights for free, the first-batch scales are
stale unless the engine re-calibrates.

Second table (issue 21): FP8 q/k/v attention on the FP8 cache, prefill and every decode step
(``wrap(model, kv_cache="fp8", lowering="fp8_qkv")``), on tiny random-weight models of three
families (``QKV_FAMILIES``: Llama MHA, GPT-2 fused c_attn, Mistral GQA) with dynamic and
static caches. Teacher forced (the unquantized model's greedy tokens forced through
``generate``), relative L2 of the logits at the generated positions against the unquantized
model, for: geoscale (q from the weights, k/v descales = the FP8 cache's own scales); (a)
ideal dynamic descales — per (batch, kv head) amax of the actual q/k/v each call / R_max, as
torchao's low-precision attention — and (b) unit descales, both on the same FP8 cache and the
same emulated FA3 FP8 attention; and the FP8 cache alone (exact attention). Run alone with
``python -m bench.scenarios.kv_cache``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch._dynamo.utils import counters as dynamo_counters
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer

import geoscale_fx
from bench.quality import first_divergence, logit_metrics, spread
from bench.runner import Context, ScenarioResult
from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.core.fp8 import quantize_dequantize
from geoscale_fx.testing.hf_configs import tiny_model
from geoscale_fx.kv_cache.layers import cache_nbytes, fp8_cache
from geoscale_fx.kv_cache.manager import KVCacheManager, cache_argument
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.kernels.qkv_attention import emulated_fp8_attention
from geoscale_fx.kv_cache.weight_scales import WeightKVScales

__all__ = ["fp8_kv_cache", "METHODS", "SEEDS", "QKV_FAMILIES", "fp8_qkv_decode_errors",
           "fp8_qkv_decode_rows"]

FMT = "e4m3"
#: vLLM's defaults (vllm/envs.py): k_scale = amax(k) / 200, v_scale = amax(v) / 100
VLLM_K_CONSTANT, VLLM_V_CONSTANT = 200.0, 100.0
METHODS = ("geometry", "unit (1.0)", "first batch", "ideal per step")
#: prompts (batches) every quality number is measured over
SEEDS = 3


class _IdealLayer(DynamicLayer):
    """Per step and per head: new states quantized with their own max (kept dequantized)."""

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(self._fake(key_states), self._fake(value_states), *args, **kwargs)

    @staticmethod
    def _fake(states: torch.Tensor) -> torch.Tensor:
        scale = states.abs().amax(dim=(0, 2, 3), keepdim=True).float() / fp8_max(FMT)
        scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
        return (quantize_dequantize(states.float() / scale, FMT) * scale).to(states.dtype)


def _ideal_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        ideal = object.__new__(_IdealLayer)
        ideal.__dict__.update(layer.__dict__)
        cache.layers[i] = ideal
    return cache


def _layer_scales(per_layer_k: list, per_layer_v: list) -> list[LayerScales]:
    """LayerScales whose ``scales()`` give ``k``/``v`` (bounds = scale · R_max)."""
    limit = fp8_max(FMT)
    return [LayerScales(i, "", torch.ones(1), k.double() * limit, v.double() * limit)
            for i, (k, v) in enumerate(zip(per_layer_k, per_layer_v))]


def _plain_cache(model, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_argument(): cache})
    return cache


def _first_batch_scales(model, ids: torch.Tensor) -> list[LayerScales]:
    cache = _plain_cache(model, ids)
    return _layer_scales([c.keys.abs().amax().reshape(1) / VLLM_K_CONSTANT for c in cache.layers],
                         [c.values.abs().amax().reshape(1) / VLLM_V_CONSTANT
                          for c in cache.layers])


def _cache(model, layer_scales: list[LayerScales] | None):
    """A fresh cache and its saturation counters (None for the oracle)."""
    if layer_scales is None:
        return _ideal_cache(model.config), None
    counters = [torch.zeros(2, dtype=torch.int64) for _ in layer_scales]
    return fp8_cache(model.config, layer_scales, FMT, counters), counters


def _shifted(layer_scales: list[LayerScales], factor: float) -> list[LayerScales]:
    return [LayerScales(s.layer, s.site, s.q_bound, s.k_bound * factor, s.v_bound * factor)
            for s in layer_scales]


def _greedy(model, ids: torch.Tensor, new: int, cache=None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0,
                              **{cache_argument(): cache})


def _teacher_forced(model, tokens: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Logits ``(steps, B, V)`` predicting tokens ``prompt_len..`` one step at a time."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    passed = {cache_argument(): cache}
    with torch.no_grad():
        logits = [model(tokens[:, :prompt_len], use_cache=True, **passed).logits[:, -1]]
        for t in range(prompt_len, tokens.shape[1] - 1):
            logits.append(model(tokens[:, t:t + 1], use_cache=True, **passed).logits[:, -1])
    return torch.stack(logits).float()


def _utilization(cache, layer_scales) -> float:
    """Largest |entry / scale| / R_max over the cache (from the stored FP8 values)."""
    if layer_scales is None:
        return 1.0
    worst = 0.0
    for layer in cache.layers:
        for bits in (layer.keys, layer.values):
            worst = max(worst, float(bits.view(torch.float8_e4m3fn).float().abs().max()))
    return worst / fp8_max(FMT)


def _reference(model, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unquantized model's greedy tokens after ``prompt`` and its teacher-forced logits
    ``(steps, B, V)`` on them."""
    tokens = _greedy(model, prompt, new)
    return tokens, _teacher_forced(model, tokens, prompt.shape[1], None)


def _evaluate(model, layer_scales, references: list, prompt_len: int) -> dict:
    """One scale source over every reference: teacher-forced metrics per prompt, the first
    divergence of free-running greedy decoding per sequence, saturation and range use."""
    found = {"rel_l2": [], "kl": [], "top1": [], "divergence": [], "saturated": 0,
             "utilization": 0.0}
    for tokens, ref_logits in references:
        cache, counters = _cache(model, layer_scales)
        logits = _teacher_forced(model, tokens, prompt_len, cache)
        for key, value in logit_metrics(ref_logits, logits).items():
            found[key].append(value)
        if counters is not None:
            found["saturated"] += int(sum(int(c.sum()) for c in counters))
        found["utilization"] = max(found["utilization"], _utilization(cache, layer_scales))
        greedy = _greedy(model, tokens[:, :prompt_len], tokens.shape[1] - prompt_len,
                         _cache(model, layer_scales)[0])
        found["divergence"] += [first_divergence(a, b) for a, b in
                                zip(tokens[:, prompt_len:], greedy[:, prompt_len:])]
    found["bytes"] = None if counters is None else cache_nbytes(cache)
    return found


def _band(model, layer_scales, reference: tuple, prompt_len: int, rel_l2: float) -> str | None:
    """Relative L2 on one reference with the scales multiplied by 2^(k/4), k = 0..3
    (``rel_l2``: k = 0): 'min-max'."""
    if layer_scales is None:
        return None
    tokens, ref_logits = reference
    band = [rel_l2]
    for k in range(1, 4):
        cache = _cache(model, _shifted(layer_scales, 2 ** (k / 4)))[0]
        logits = _teacher_forced(model, tokens, prompt_len, cache)
        band.append(logit_metrics(ref_logits, logits)["rel_l2"])
    return f"{min(band):.3g}-{max(band):.3g}"


def _measure(lm, model, phase: str, scales: dict, prompts: list, new: int) -> list[dict]:
    prompt_len = prompts[0].shape[1]
    references = [_reference(model, prompt, new) for prompt in prompts]
    plain = _plain_cache(model, references[0][0][:, :-1])   # what teacher forcing caches
    plain_bytes = cache_nbytes(plain)
    bf16_bytes = plain_bytes // plain.layers[0].keys.element_size() * 2
    dtype_name = str(plain.layers[0].keys.dtype).replace("torch.", "")
    rows = []
    for method, layer_scales in scales.items():
        found = _evaluate(model, layer_scales, references, prompt_len)
        fp8 = found["bytes"]
        k_scale = None if layer_scales is None else float(
            torch.stack([s.scales(FMT)[0].max() for s in layer_scales]).max())
        rows.append({
            "model": lm.name, "phase": phase, "method": method,
            "cache MB": None if fp8 is None else fp8 / 2 ** 20,
            f"vs {dtype_name}": None if fp8 is None else fp8 / plain_bytes,
            "vs bf16": None if fp8 is None else fp8 / bf16_bytes,
            "logit rel. L2": spread(found["rel_l2"]), "KL/token": spread(found["kl"]),
            "top-1 agree": spread(found["top1"]),
            "first divergence": spread(found["divergence"]),
            "identical": f"{found['divergence'].count(None)}/{len(found['divergence'])}",
            "error, scale x2^(k/4)": _band(model, layer_scales, references[0], prompt_len,
                                           found["rel_l2"][0]),
            "saturated": None if fp8 is None else found["saturated"],
            "max |x|/scale / R_max": found["utilization"], "max k_scale": k_scale})
    return rows


def _fine_tune(lm, model, ctx: Context, steps: int, lr: float) -> float:
    """AdamW steps on training text; the relative change of the key projections' norm."""
    keys = [p for n, p in model.named_parameters() if "k_proj" in n or "c_attn" in n]
    before = torch.stack([p.detach().norm() for p in keys])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = ctx.generator(12)
    for _ in range(steps):
        loss = lm.loss(model, lm.batch(gen, 8, 64, "train"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    after = torch.stack([p.detach().norm() for p in keys])
    return float(((after - before).abs() / before).max())


def fp8_kv_cache(ctx: Context) -> ScenarioResult:
    """12. FP8 KV cache: geometry, unit, first-batch and ideal scales, before and after a
    fine-tuning phase."""
    lms = ctx.causal_lms()
    new = ctx.steps(48, 96)
    batch = ctx.pick(4, 8)
    tune_steps, lr = ctx.steps(20, 40), 1e-3
    result = ScenarioResult(
        "fp8-kv-cache", f"12. FP8 (E4M3) KV cache: greedy decoding of {new} tokens, batch "
        f"{batch}, scales from the weights vs 1.0 vs the first batch vs ideal; then after "
        f"{tune_steps} fine-tuning steps (AdamW, lr {lr:g})",
        notes=f"Against the unquantized model, on {SEEDS} prompt batches; cells "
        "'median [min–max]' over them. Teacher forcing: the unquantized model's own greedy "
        "tokens fed one per call through the FP8 cache, logits at the generated positions "
        "compared with the unquantized model's. 'logit rel. L2': ||logits - unquantized|| / "
        "||unquantized|| over a batch's generated positions; 'KL/token': KL(unquantized || "
        "FP8) of the next-token distributions, mean over those positions; 'top-1 agree': share "
        "of them with the unquantized argmax. 'first divergence': per sequence, the index of "
        "the first free-running greedy token that differs from the unquantized model's ('—' = "
        "none, ranked after every index); 'identical': sequences with none. 'saturated': cache "
        "entries with |x/scale| >= 448 (clamped), summed over the prompts. 'max |x|/scale / "
        "R_max': how much of the FP8 range the stored entries use (1 for the oracle by "
        "construction). 'error, scale x2^(k/4)': the relative L2 on the first prompt batch "
        "with the method's scales multiplied by 2^(k/4), k = 0..3 (all certified for "
        "geometry): E4M3's relative precision does not depend on the scale while values stay "
        "normal, so this band is the rounding noise of the measurement, not a property of the "
        "method. "
        "First-batch scales follow vLLM's calc_kv_scales "
        f"(amax/{VLLM_K_CONSTANT:g} for k, amax/{VLLM_V_CONSTANT:g} for v, per layer) on a "
        "calibration batch of other text, frozen: after fine-tuning they are stale (an engine "
        "would need another calibration pass); geometry's are re-derived from the new weights. "
        "'ideal per step' is an oracle: each step's states with their own per-head max.")
    bar = ctx.bar(len(lms) * 2 * len(METHODS), "fp8 kv cache")
    for lm in lms:
        model = lm.build()
        prompts = [lm.batch(ctx.generator(21 + 100 * seed), batch, 64, "val")["input_ids"]
                   for seed in range(SEEDS)]
        calibration = lm.batch(ctx.generator(22), batch, 64, "val")["input_ids"]
        source = WeightKVScales(model).capture(prompts[0][:1, :8])
        first_batch = _first_batch_scales(model, calibration)
        unit = _layer_scales([torch.ones(1)] * len(first_batch),
                             [torch.ones(1)] * len(first_batch))
        for phase in ("pretrained", "fine-tuned"):
            if phase == "fine-tuned":
                change = _fine_tune(lm, model, ctx, tune_steps, lr)
                result.data.setdefault("key_weight_change", {})[lm.name] = change
            scales = {"geometry": source.layers(), "unit (1.0)": unit,
                      "first batch": first_batch, "ideal per step": None}
            rows = _measure(lm, model, phase, scales, prompts, new)
            result.rows += rows
            bar.update(len(rows))
    bar.close()
    qkv_rows = fp8_qkv_decode_rows(ctx)
    result.data["fp8_qkv_decode"] = qkv_rows
    result.notes += ("\n\n**FP8 q/k/v attention on the FP8 cache, prefill and every decode "
                     "step** (issue 21; tiny random-weight models, see the module docstring; "
                     "'rel. L2 …': logits against the unquantized model, teacher forced):\n\n"
                     + tabulate([list(r.values()) for r in qkv_rows],
                                headers=list(qkv_rows[0].keys()), tablefmt="github",
                                floatfmt=".4g"))
    from bench.plots import kv_cache_plot

    result.plots.append(kv_cache_plot(result.rows, ctx.out_dir / "fp8_kv_cache.png"))
    return result


# --------------------------------------------------------------------------------------
# FP8 q/k/v attention on the FP8 cache (issue 21)
# --------------------------------------------------------------------------------------

#: (family of ``geoscale_fx.testing.hf_configs.tiny_model``, what its attention exercises)
QKV_FAMILIES = (("llama", "MHA, RoPE"), ("gpt2", "MHA, fused c_attn"),
                ("mistral", "GQA 4:1, RoPE"))


class _Forced(LogitsProcessor):
    """Teacher forcing through ``generate``: the next token is ``tokens[:, t]`` (the raw
    logits stay in ``output_logits``)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        return forced.scatter_(1, self.tokens[:, input_ids.shape[1], None], 0.0)


@contextlib.contextmanager
def _fp8_sdpa(mode: str, saturated: list):
    """``F.scaled_dot_product_attention`` replaced by the emulated FA3 FP8 attention with
    ``mode`` descales: "dynamic" — per (batch, kv head) ``amax / R_max`` of this call's q
    (over its GQA group), k and v; "unit" — 1.0. ``saturated`` collects, per call, how many
    entries reached ±R_max."""
    original, top = F.scaled_dot_product_attention, fp8_max(FMT)

    def descale(x: torch.Tensor, n_kv: int) -> torch.Tensor:        # (B, H_kv)
        if mode == "unit":
            return torch.ones(x.shape[0], n_kv)
        amax = x.detach().abs().float().amax(dim=(2, 3))             # (B, H)
        amax = amax.reshape(x.shape[0], n_kv, -1).amax(dim=-1)
        return (amax / top).clamp_min(torch.finfo(torch.float32).tiny)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        n_kv = k.shape[1]
        d = [descale(x, n_kv) for x in (q, k, v)]
        saturated.append(sum(int((x.float() / dd.repeat_interleave(
            x.shape[1] // n_kv, dim=1)[:, :, None, None]).abs().gt(top * (1 + 1e-5)).sum())
            for x, dd in zip((q, k, v), d)))
        return emulated_fp8_attention(q, k, v, *d, attn_mask=attn_mask, is_causal=is_causal,
                                      softmax_scale=scale if scale is not None
                                      else q.shape[-1] ** -0.5, fmt=FMT)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _forced_logits(model, prompt: torch.Tensor, tokens: torch.Tensor, **kw) -> torch.Tensor:
    """``(steps, B, V)`` raw logits of ``generate`` forced along ``tokens``."""
    new = tokens.shape[1] - prompt.shape[1]
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([_Forced(tokens)]), **kw)
    return torch.stack(out.logits).float()


def fp8_qkv_decode_errors(model, prompt: torch.Tensor, new: int, *, static: bool,
                          compiler: str = "eager") -> dict:
    """Logit errors (relative L2 against the unquantized model, teacher forced) of FP8 q/k/v
    attention on geoscale's FP8 cache with: geoscale's descales (``wrap(model,
    kv_cache="fp8", lowering="fp8_qkv")``), ideal dynamic ones, unit ones; and of the FP8
    cache alone. Also what the geoscale run did: rewrites, fallbacks, steps per site,
    overflows, saturated cache entries (``model`` is wrapped: pass a fresh one)."""
    torch._dynamo.reset()
    kw = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **kw)
    tokens, exact = out.sequences, torch.stack(out.logits).float()
    found = {}
    manager = KVCacheManager(model, "fp8")
    for mode in ("cache only", "dynamic", "unit"):
        cache = manager.new_cache(prompt, static=static, max_cache_len=tokens.shape[1])
        saturated: list = []
        with _fp8_sdpa(mode, saturated) if mode != "cache only" else contextlib.nullcontext():
            logits = _forced_logits(model, prompt, tokens, **{cache_argument(): cache})
        found[mode] = logit_metrics(exact, logits)["rel_l2"]
        found[f"{mode} saturated"] = sum(saturated)
    found["cache saturated"] = manager.saturated_total()
    before = dict(dynamo_counters["geoscale"])
    wrapped = geoscale_fx.wrap(model, kv_cache="fp8", lowering="fp8_qkv", compiler=compiler)
    logits = _forced_logits(wrapped, prompt, tokens, **kw)
    after = dynamo_counters["geoscale"]
    delta = {k: after[k] - before.get(k, 0) for k in after}
    rows = wrapped.report().rows
    found.update({
        "geoscale": logit_metrics(exact, logits)["rel_l2"],
        "rewrite_fp8_qkv": delta.get("rewrite_fp8_qkv", 0),
        "fp8_qkv_fallback": delta.get("fp8_qkv_fallback", 0),
        "k from cache scale": delta.get("fp8_qkv_k_fp8_cache", 0),
        "k observed": delta.get("fp8_qkv_k_observed", 0),
        "lowerings": sorted({r["lowering"] for r in rows}),
        "steps": [r["steps"] for r in rows], "cached_steps": [r["cached_steps"] for r in rows],
        "overflow_steps": sum(r["overflow_steps"] or 0 for r in rows),
        "kv_saturated": model._geoscale_kv_cache.saturated_total(),
        "skipped": len(wrapped.report().skipped), "eager_calls": wrapped.eager_calls,
        "calls": new})
    return found


def fp8_qkv_decode_rows(ctx: Context | None = None) -> list[dict]:
    """The second table of scenario 12 (module docstring): one row per family and cache."""
    new = 16 if ctx is None else ctx.steps(16, 32)
    rows = []
    for family, form in QKV_FAMILIES:
        for cache in ("dynamic", "static"):
            model = tiny_model(family, attn_implementation="sdpa", seed=0).eval()
            prompt = torch.randint(1, model.config.vocab_size, (2, 12),
                                   generator=torch.Generator().manual_seed(21))
            found = fp8_qkv_decode_errors(model, prompt, new, static=cache == "static")
            rows.append({
                "family": f"{family} ({form})", "cache": cache,
                "calls fp8_qkv / all": f"{min(found['steps'])}/{found['calls']}",
                "fallbacks": found["fp8_qkv_fallback"],
                "rel. L2 geoscale": found["geoscale"],
                "rel. L2 ideal dynamic": found["dynamic"], "rel. L2 unit": found["unit"],
                "rel. L2 FP8 cache only": found["cache only"],
                "geoscale / ideal": found["geoscale"] / found["dynamic"],
                "overflows (geoscale)": found["overflow_steps"] + found["kv_saturated"],
                "saturated (unit)": found["unit saturated"]})
    return rows


if __name__ == "__main__":
    table = fp8_qkv_decode_rows()
    print(tabulate([list(r.values()) for r in table], headers=list(table[0].keys()),
                   floatfmt=".4g"))
