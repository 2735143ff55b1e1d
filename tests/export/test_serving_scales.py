"""geoscale_fx.export.serving_scales: ``attention_scales`` on a hand-built block (no Hugging Face):
the k/v/q scales against the entry bound recomputed in float64 from the live weights (never
below it, at most one float32 ulp above: ``tests/float_checks.py``), the model's train/eval
flags left as they were, and the wrapper's names.
tests/test_attention_scales.py covers Hugging Face models and the RL-loop workflow."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from geoscale_fx.export.serving_scales import attention_scales
from geoscale_fx.api.wrapper import wrap
from tests.attention_variants import Block
from tests.float_checks import SCALE_ULPS, assert_certified

D, H, DH = 64, 4, 16


def _model() -> nn.Module:
    model = nn.Sequential()
    model.add_module("attn", Block(layout="separate"))
    return model


def _x():
    return torch.randn(1, 6, D, generator=torch.Generator().manual_seed(0))


def _entry_bound(linear: nn.Linear, norm: nn.LayerNorm) -> torch.Tensor:
    """(H,) max_i ρ‖g ⊙ W[i]‖ + |W[i]·β + b_i| per head, float64 (no rotary in Block)."""
    w = linear.weight.detach().double()                              # (F, d)
    a = w * norm.weight.detach().double()
    c = w @ norm.bias.detach().double()
    if linear.bias is not None:
        c = c + linear.bias.detach().double()
    entry = D ** 0.5 * torch.linalg.vector_norm(a, dim=1) + c.abs()
    return entry.reshape(H, DH).amax(dim=-1)


def test_scales_are_the_entry_bounds_of_the_live_weights():
    model = _model()
    block = model.attn
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 2.0)
        block.norm.bias.normal_()
    for step in range(2):
        inputs = (_x(),) if step == 0 else ()          # traced once, then live weights only
        scales = attention_scales(model, *inputs, strategy="head")
        assert sorted(scales) == ["attn.k_scale", "attn.q_scale", "attn.v_scale"]
        for kind in "qkv":       # in [B/448, B/448 + 1 ulp): rounded up from a float64 bound
            ref = _entry_bound(getattr(block, kind), block.norm) / 448.0
            assert_certified(scales[f"attn.{kind}_scale"].flatten(), ref, ulps=SCALE_ULPS,
                             msg=f"step {step}, {kind}")
        with torch.no_grad():                  # an update: the next call, no inputs, sees it
            block.k.weight.mul_(3.0)


def test_per_tensor_scale_is_the_largest_head_and_q_can_be_left_out():
    model = _model()
    scales = attention_scales(model, _x(), include_q=False)
    assert sorted(scales) == ["attn.k_scale", "attn.v_scale"]
    ref = _entry_bound(model.attn.v, model.attn.norm).max() / 448.0
    assert scales["attn.v_scale"].shape == (1,)
    assert_certified(scales["attn.v_scale"], ref.reshape(1), ulps=SCALE_ULPS)


def test_the_trace_runs_in_eval_mode_and_each_flag_is_restored():
    model = _model().train()
    model.attn.out.eval()                      # a module the user set apart
    seen = []
    model.attn.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    attention_scales(model, _x())
    assert seen == [False]                     # traced as it serves
    assert model.training and model.attn.training and not model.attn.out.training


def test_a_wrapper_gives_the_models_names_and_the_first_call_needs_inputs():
    model = _model().eval()
    with pytest.raises(ValueError, match="the first call for this Sequential traces it"):
        attention_scales(model)
    wrapped = wrap(model, compiler="aot_eager")
    live = attention_scales(wrapped, _x())
    assert sorted(live) == ["attn.k_scale", "attn.q_scale", "attn.v_scale"]
    assert set(attention_scales(model)) == set(live)       # the trace is kept on the model
