"""Unit tests for ``geoscale_fx.kv_cache.weight_scales``: per-layer q/k/v bounds from the weights.

Checked against independent references: the keys and values an eager forward pass puts in a
plain cache never exceed the bounds; a k projection scaled in place by 8 (exact in float32)
scales that layer's k bound by 8 (the bound is linear in W_k) and leaves the other layers'
bounds as they were; a parameter replaced by a new tensor is followed without a second trace.
"""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from geoscale_fx.core.errors import NonFiniteWeights
from geoscale_fx.kv_cache.weight_scales import WeightKVScales
from tests.hf_models import build_hf


def _ids(batch: int = 1, length: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_bounds_hold_every_key_and_value_of_an_eager_forward():
    model = build_hf("llama-sdpa")
    layers = WeightKVScales(model).capture(_ids(1, 4)).layers()
    assert [(s.layer, s.site) for s in layers] == [
        (i, f"model.layers.{i}.self_attn") for i in range(2)]
    assert [tuple(s.k_bound.shape) for s in layers] == [(2,), (2,)]     # per kv head
    assert [tuple(s.q_bound.shape) for s in layers] == [(4,), (4,)]     # per query head
    worst = 0.0
    for seed in range(3):
        with torch.no_grad():
            cache = model(_ids(2, 12, seed), use_cache=True).past_key_values
        for scales, cached in zip(layers, cache.layers):
            for bound, states in ((scales.k_bound, cached.keys), (scales.v_bound, cached.values)):
                amax = states.abs().amax(dim=(0, 2, 3)).double()          # per kv head
                assert bool((amax <= bound).all()), (scales.site, amax, bound)
                worst = max(worst, float((amax / bound).max()))
    assert worst > 0.01                                                   # not vacuous


def test_an_in_place_update_is_followed_and_nothing_else_is_recomputed(traces):
    model = build_hf("llama-sdpa")
    source = WeightKVScales(model).capture(_ids())
    before = source.layers()
    assert source.layers() is before                   # unchanged weights: no recomputation
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(8.0)
    after = source.layers()
    assert after is not before and len(traces) == 1
    torch.testing.assert_close(after[1].k_bound, 8.0 * before[1].k_bound, rtol=1e-9, atol=0)
    assert torch.equal(after[1].v_bound, before[1].v_bound)
    assert torch.equal(after[0].k_bound, before[0].k_bound)


def test_a_replaced_parameter_is_followed_without_a_second_trace(traces):
    model = build_hf("llama-sdpa")
    source = WeightKVScales(model).capture(_ids())
    before = source.layers()
    attention = model.model.layers[0].self_attn
    attention.v_proj.weight = nn.Parameter(attention.v_proj.weight.detach() * 4.0)
    after = source.layers()
    assert len(traces) == 1
    torch.testing.assert_close(after[0].v_bound, 4.0 * before[0].v_bound, rtol=1e-9, atol=0)
    assert torch.equal(after[1].v_bound, before[1].v_bound)


def test_refusals_name_the_parameter_or_the_missing_capture():
    model = build_hf("llama-sdpa")
    source = WeightKVScales(model)
    with pytest.raises(RuntimeError, match="capture"):
        source.layers()
    source.capture(_ids())
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteWeights,
                       match=r"model\.layers\.1\.self_attn.*v_proj\.weight.*1 inf/nan"):
        source.layers()
    with pytest.raises(ValueError, match="no attention found in Sequential"):
        WeightKVScales(nn.Sequential(nn.Linear(4, 4))).capture(torch.randn(2, 4))


def test_a_swapped_storage_is_followed_a_buffer_written_in_place_is_not(traces):
    """``p.data = t`` (what ``module.to`` does) moves a parameter to a new storage without a
    write: followed. A buffer's contents are not tracked (geoscale's own state is written by
    every compiled call); a buffer replaced by another tensor is a rebind, as a parameter."""
    model = build_hf("llama-sdpa")
    source = WeightKVScales(model).capture(_ids())
    before = source.layers()
    rotary = model.model.rotary_emb
    with torch.no_grad():
        rotary.inv_freq.mul_(1.0)
    assert source.layers() is before
    k_proj = model.model.layers[0].self_attn.k_proj
    with torch.no_grad():
        k_proj.weight.data = k_proj.weight.detach() * 2.0
    after = source.layers()
    torch.testing.assert_close(after[0].k_bound, 2.0 * before[0].k_bound, rtol=1e-9, atol=0)
    assert source.layers() is after
    rotary.inv_freq = rotary.inv_freq.clone()
    rebound = source.layers()
    assert rebound is not after and len(traces) == 1
    assert all(torch.equal(a.k_bound, b.k_bound) for a, b in zip(rebound, after))


def test_inference_mode_parameters_are_evaluated_every_call():
    """Tensors made in inference mode keep no version counter: whether they changed cannot
    be told, so every ``layers()`` evaluates the bounds again (never stale, never an error)."""
    model = build_hf("llama-sdpa")
    source = WeightKVScales(model).capture(_ids())
    before = source.layers()
    model.requires_grad_(False)
    with torch.inference_mode():          # weights loaded for serving, in inference mode
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()},
                              assign=True)
    first = source.layers()
    assert first is not before and source.layers() is not first
    assert all(torch.equal(a.k_bound, b.k_bound) for a, b in zip(first, before))
    with torch.inference_mode():
        model.model.layers[1].self_attn.k_proj.weight.mul_(8.0)
    torch.testing.assert_close(source.layers()[1].k_bound, 8.0 * before[1].k_bound,
                               rtol=1e-9, atol=0)


def test_a_forward_a_client_set_on_the_model_is_never_called(traces):
    """TRL's GRPO replaces ``model.forward`` by a fused-LM-head wrapper; the FP8 cache's
    capture (ids alone) called it and failed. The capture traces the class's forward: the
    same cache layers and bounds as the model without the wrapper, under its own names, and
    the wrapper is not called."""
    model = build_hf("llama-sdpa")
    plain = WeightKVScales(model).capture(_ids()).layers()
    calls = []

    def fused_forward(self, *args, fused_lm_head, labels, **kwargs):    # no defaults
        calls.append(fused_lm_head)
        return type(self).forward(self, *args, labels=labels, **kwargs)

    model.forward = types.MethodType(fused_forward, model)
    layers = WeightKVScales(model).capture(_ids()).layers()
    assert calls == [] and len(traces) == 2
    assert [(s.layer, s.site) for s in layers] == [(s.layer, s.site) for s in plain] == [
        (i, f"model.layers.{i}.self_attn") for i in range(2)]
    for a, b in zip(layers, plain):     # the same weights along the same path
        assert all(torch.equal(x, y) for x, y in zip((a.q_bound, a.k_bound, a.v_bound),
                                                     (b.q_bound, b.k_bound, b.v_bound)))
