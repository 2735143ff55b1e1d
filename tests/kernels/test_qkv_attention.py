"""geoscale_fx.kernels.qkv_attention: the FP8 q/k/v attention emulation and its descale helpers.

The emulation is checked against a float64 recomputation written here from the module
docstring's semantics, on q/k/v rounded by ``fp8.quantize_dequantize`` (the end-to-end and
mask/causal cases live in tests/test_fp8_qkv.py)."""
from __future__ import annotations

import math

import pytest
import torch

from geoscale_fx.core.fp8 import quantize_dequantize
from geoscale_fx.kernels.qkv_attention import (
    P_OFFSET, emulated_fp8_attention, fa3_available, group_descale, operand_scaled_max,
)


def _reference(q, k, v, dq, dk, dv, scale, fmt):
    """O = δ_v · (Q(P̃) v₈) / ℓ per query head h (kv head h // G), in float64."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    for h in range(q.shape[1]):
        g = h // group
        q8 = quantize_dequantize(q[:, h].float() / float(dq[g]), fmt).double()
        k8 = quantize_dequantize(k[:, g].float() / float(dk[g]), fmt).double()
        v8 = quantize_dequantize(v[:, g].float() / float(dv[g]), fmt).double()
        s = scale * float(dq[g]) * float(dk[g]) * (q8 @ k8.transpose(-2, -1))   # (B, L, S)
        p = P_OFFSET * torch.exp(s - s.amax(dim=-1, keepdim=True))
        p8 = quantize_dequantize(p.float(), fmt).double()
        out[:, h] = float(dv[g]) * (p8 @ v8) / p.sum(dim=-1, keepdim=True)
    return out


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_emulation_equals_a_float64_reference_under_gqa(fmt):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g) * 3                 # (B, H_q, L, E)
    k = torch.randn(2, 2, 6, 8, generator=g) * 2                 # (B, H_kv, S, E)
    v = torch.randn(2, 2, 6, 8, generator=g)
    dq, dk, dv = torch.tensor([0.02, 0.03]), torch.tensor([0.01, 0.02]), torch.tensor([0.005, 0.01])
    scale = 1 / math.sqrt(8)
    out = emulated_fp8_attention(q, k, v, dq, dk, dv, softmax_scale=scale, is_causal=False,
                                 fmt=fmt)
    expected = _reference(q, k, v, dq, dk, dv, scale, fmt)
    assert out.dtype == q.dtype and out.shape == (2, 4, 5, 8)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    # the FP8 rounding is really there: the unquantized attention differs
    exact = torch.softmax(scale * q @ k.repeat_interleave(2, 1).transpose(-2, -1), -1) \
        @ v.repeat_interleave(2, 1)
    assert (out - exact).abs().max() > 1e-4


def test_group_descale_is_the_max_over_each_gqa_group():
    per_head = torch.tensor([1.0, 5.0, 2.0, 0.5, 7.0, 3.0])      # n_q = 6
    assert torch.equal(group_descale(per_head, 2), torch.tensor([5.0, 7.0]))
    assert torch.equal(group_descale(per_head, 6), per_head)      # MHA: one head a group
    with pytest.raises(RuntimeError):
        group_descale(per_head, 4)                                # 6 heads in 4 groups


def test_operand_scaled_max_per_kv_head():
    x = torch.zeros(2, 4, 3, 2)                                   # H = 4 heads, H_kv = 2
    x[1, 0, 2, 1] = -6.0
    x[0, 1, 0, 0] = 4.0
    x[0, 3, 1, 1] = 9.0
    descale = torch.tensor([2.0, 3.0])
    got = operand_scaled_max(x, descale)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.tensor([6.0 / 2.0, 9.0 / 3.0]))


def test_fa3_is_unavailable_off_cuda():
    assert fa3_available("cpu") is False
    assert fa3_available("mps") is False
