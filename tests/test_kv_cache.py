"""``kv_cache="fp8"``: an FP8 KV cache whose per-kv-head scales come from the weights.

Checked against independent references: the keys and values a plain (unquantized) cache holds
never exceed the predicted bounds (so no cached entry saturates), the FP8 cache's contents
equal a float64 re-implementation of E4M3 round-to-nearest-even of ``K / k_scale``, the cache
takes half the bytes of a bf16 one, and generation stays close to the unquantized model."""
from __future__ import annotations

import math

import pytest
import torch

import geoscale_fx
from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.kv_cache.weight_scales import WeightKVScales
from tests.analysis_checks import scale_up_gains_and_biases
from tests.hf_models import (NEW_TOKENS, build_hf, cache_bytes, kv_cache_runs, plain_cache,
                             prompt)

pytestmark = pytest.mark.zoo

FAMILIES = ["llama-sdpa", "gpt2-sdpa", "qwen2-sdpa"]


def _inflated(key: str):
    """Gains and q/k biases ×4, layer 1's key/value projections ×10 (a wrong layer mapping
    would show)."""
    model = build_hf(key)
    scale_up_gains_and_biases(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (".1." in name or ".h.1." in name) and any(
                    t in name for t in ("k_proj", "v_proj", "c_attn")):
                p.mul_(10.0)
    return model


def _generate(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("key", FAMILIES)
def test_predicted_bounds_hold_every_cached_key_and_value(key):
    """Every entry of every layer's cached keys/values (an unquantized cache, many prompts)
    is within the layer's predicted per-head bound."""
    model = _inflated(key)
    scales = WeightKVScales(model).capture(prompt(1, 4))
    layers = scales.layers()
    assert [s.layer for s in layers] == list(range(model.config.num_hidden_layers))
    worst = 0.0
    for seed in range(3):
        cache = plain_cache(model, prompt(2, 10, seed))
        for layer, cached in zip(layers, cache.layers):
            for bound, states in ((layer.k_bound, cached.keys), (layer.v_bound, cached.values)):
                amax = states.abs().amax(dim=(0, 2, 3)).double()         # per kv head
                assert bool((amax <= bound).all()), (layer.site, amax, bound)
                worst = max(worst, float((amax / bound).max()))
    print(f"\n{key}: worst cached |entry| / bound = {worst:.3f}")
    assert worst > 0.01         # the bounds are not vacuous


def _e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """float64 reference of the saturating cast to E4M3 (3 mantissa bits, min normal 2^-6,
    subnormal step 2^-9), round to nearest even."""
    x = x.double().clamp(-448.0, 448.0)
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -30))).clamp_min(-6)
    step = torch.pow(2.0, exponent - 3)
    return torch.round(x / step) * step        # torch.round: half to even


def test_fp8_cache_holds_the_rounded_keys_and_values_of_the_first_layer():
    """Layer 0's cached bits, read as E4M3 and times k_scale, are the float64 reference
    rounding of the unquantized keys (layer 0 sees the same embeddings in both runs)."""
    model = build_hf("llama-sdpa")
    ids = prompt()
    reference = plain_cache(model, ids).layers[0]
    wrapped = geoscale_fx.wrap(model, kv_cache="fp8", scaling="none", compiler="aot_eager")
    manager = model._geoscale_kv_cache
    cache = manager.new_cache(ids)
    with torch.no_grad():
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                         do_sample=False, pad_token_id=0, past_key_values=cache)
    layer = cache.layers[0]
    assert layer.keys.dtype == torch.uint8
    for bits, scale, ref in ((layer.keys, layer.k_scale, reference.keys),
                             (layer.values, layer.v_scale, reference.values)):
        stored = bits.view(torch.float8_e4m3fn).double()
        # the prompt's positions: same inputs in both runs, and aot_eager replays eager's aten
        # ops, so layer 0's keys are the same bits (checked with ATEN_CPU_CAPABILITY=default
        # and MKL_CBWR=COMPATIBLE too)
        length = ids.shape[1]
        expected = _e4m3_round(ref[:, :, :length].double() / scale.double().view(1, -1, 1, 1))
        assert torch.equal(stored[:, :, :length], expected)


@pytest.mark.parametrize("key, cache", [("llama-sdpa", "dynamic"), ("llama-sdpa", "static"),
                                        ("gpt2-sdpa", "dynamic"), ("qwen2-sdpa", "static")])
def test_fp8_cache_generation_matches_ideal_per_head_scaling(key, cache):
    """Logit error against the unquantized model: geometry's certified scales within 1.5× of
    ideal per-head scales (FP8's relative precision does not depend on the scale while values
    stay normal), and 0 saturations."""
    model = _inflated(key)
    runs = kv_cache_runs(model, prompt(), "fp8", static=cache == "static")
    ref, wrapped = runs.reference, runs.wrapped

    def error(logits):      # the first generated token: both runs see the same prefix
        return float((logits[0] - ref[0]).abs().max() / ref[0].abs().max())

    equal = float((runs.tokens == runs.reference_tokens).float().mean())
    print(f"\n{key} {cache}: first-token logit error geometry {error(runs.certified):.4f}, "
          f"ideal {error(runs.observed):.4f}; tokens equal {equal}")
    assert 0 < error(runs.certified) <= 1.5 * error(runs.observed) + 0.01
    rows = wrapped.report().rows
    assert rows and all(r["kv_saturated"] == 0 and r["k_scale"] > 0 for r in rows)
    assert model._geoscale_kv_cache.saturated_total() == 0
    assert not wrapped.report().skipped        # every prefill and decode site rewritten
    layers = model._geoscale_kv_cache.last_layers
    assert type(layers) is list and all(layer.k_bound.dtype == torch.float64 for layer in layers)


def test_fp8_cache_takes_half_the_bytes_of_a_bf16_cache():
    fp8, bf16, _ = cache_bytes(build_hf("llama-sdpa").to(torch.bfloat16), "fp8")
    assert fp8 * 2 == bf16


def test_scales_follow_the_weights_and_a_cache_keeps_its_own():
    model = build_hf("llama-sdpa")
    wrapped = geoscale_fx.wrap(model, kv_cache="fp8_e5m2", scaling="none",
                               compiler="aot_eager")
    ids = prompt()
    with torch.no_grad():
        _generate(wrapped, ids)
    manager = model._geoscale_kv_cache
    before = [layer.scales("e5m2") for layer in manager.last_layers]
    kept = manager.new_cache(ids)
    with torch.no_grad():                  # an in-place update, as an optimizer step does
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(2.0)
    with torch.no_grad():
        _generate(wrapped, ids)
    after = [layer.scales("e5m2") for layer in manager.last_layers]
    for (k0, v0), (k1, v1) in zip(before, after):
        torch.testing.assert_close(k1, 2 * k0)          # no bias: the bound is linear in W_k
        torch.testing.assert_close(v1, v0)
    assert torch.equal(kept.layers[0].k_scale, before[0][0])
    assert math.isclose(fp8_max("e5m2"), 57344.0)


def test_apply_form_generates_with_the_fp8_cache():
    model = build_hf("qwen2-sdpa")
    ids = prompt()
    with torch.no_grad():
        ref = _generate(model, ids)
    geoscale_fx.apply_(model, kv_cache="fp8", compiler="aot_eager")
    with torch.no_grad():
        out = _generate(model, ids)
    assert out.shape == ref.shape
    rows = geoscale_fx.report(model).rows
    assert len(rows) == 2 and all(r["kv_saturated"] == 0 for r in rows)
    assert all(r["cached_steps"] > 0 for r in rows)


def test_a_cache_the_caller_passes_is_used_as_is_with_a_warning(caplog):
    from transformers import DynamicCache

    model = build_hf("llama-sdpa")
    wrapped = geoscale_fx.wrap(model, kv_cache="fp8", compiler="aot_eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), caplog.at_level("WARNING", logger="geoscale_fx"):
        _generate(wrapped, prompt(), past_key_values=cache)
    assert "used as is (not FP8)" in caplog.text
    assert cache.layers[0].keys.dtype == torch.float32


def test_bad_kv_cache_values_are_refused_by_name():
    from models_zoo.nanogpt import GPT, GPTConfig

    with pytest.raises(ValueError, match="kv_cache='int8'.*fp8_e5m2"):
        geoscale_fx.wrap(build_hf("llama-sdpa"), kv_cache="int8")
    nano = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="GPT keeps its own cache"):
        geoscale_fx.apply_(nano, kv_cache="fp8", compiler="aot_eager")


def test_non_finite_weights_are_refused_by_site_name():
    model = build_hf("llama-sdpa")
    wrapped = geoscale_fx.wrap(model, kv_cache="fp8", scaling="none", compiler="aot_eager")
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="model.layers.1.self_attn.*not finite"):
        _generate(wrapped, prompt())
