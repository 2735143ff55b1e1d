"""Unit tests for ``geoscale_fx.core.fp8``: formats, the FP8 round trip, fake quantization, overflow.

Expected values come from an independent model of the formats (``_reference_round``: round to
nearest even on a grid of ``mantissa_bits`` fractional bits per binade), from enumerating
every FP8 bit pattern, and from ``torch.finfo`` — never from the functions under test.
"""
import math

import pytest
import torch

from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.core.fp8 import (FP8_DTYPES, OVERFLOW_RTOL, fake_quantize_logits, fp8_dtype,
                             overflowed, quantize_dequantize, saturating_cast, scaled_abs_max)

FMTS = ("e4m3", "e5m2")
TORCH_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# (explicit mantissa bits, exponent of the smallest normal, largest finite value), OCP FP8 spec
FORMAT = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}


def _reference_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 rounding of float64 ``x`` computed arithmetically (no FP8 dtype involved).

    Round to nearest, ties to even, on the grid ``2^(e - mantissa_bits)`` of ``x``'s binade
    (``e`` clamped at the smallest normal exponent, which gives the subnormals). Both formats
    saturate at ±R_max (``quantize_dequantize`` clamps before the cast).
    """
    mant_bits, emin, vmax = FORMAT[fmt]
    a = x.abs()
    _, e = torch.frexp(a)                       # a = m·2^e, m in [0.5, 1): floor(log2 a) = e−1
    step = torch.pow(2.0, ((e - 1).clamp_min(emin) - mant_bits).to(torch.float64))
    r = torch.round(a / step) * step            # torch.round is round-half-to-even
    r = r.clamp_max(vmax)
    return torch.copysign(r, x)


def _all_finite_fp8_values(fmt: str) -> torch.Tensor:
    """Every finite value of the format, by enumerating all 256 bit patterns."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(TORCH_DTYPE[fmt])
    values = values.to(torch.float64)
    return values[values.isfinite()]


# --------------------------------------------------------------------------------------
# fp8_dtype and the R_max it is paired with
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_dtype_maps_names_to_torch_dtypes(fmt):
    """Each format name maps to the matching torch dtype, and FP8_DTYPES lists exactly these."""
    assert fp8_dtype(fmt) is TORCH_DTYPE[fmt]
    assert FP8_DTYPES == TORCH_DTYPE


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_max_agrees_with_torch_finfo_and_the_enumerated_values(fmt):
    """R_max used for overflow accounting is the format's largest finite value."""
    assert fp8_max(fmt) == torch.finfo(TORCH_DTYPE[fmt]).max == FORMAT[fmt][2]
    assert _all_finite_fp8_values(fmt).abs().max().item() == fp8_max(fmt)


@pytest.mark.parametrize("call", [
    lambda fmt: fp8_dtype(fmt),
    lambda fmt: saturating_cast(torch.ones(2), fmt),
    lambda fmt: quantize_dequantize(torch.ones(2), fmt),
    lambda fmt: fake_quantize_logits(torch.ones(2), torch.ones(1), fmt),
    lambda fmt: overflowed(torch.ones(2), fmt),
], ids=["fp8_dtype", "saturating_cast", "quantize_dequantize", "fake_quantize_logits",
        "overflowed"])
@pytest.mark.parametrize("bad", ["e4m3fn", "E4M3", "fp8", ""])
def test_unknown_format_raises_value_error_naming_allowed_values(call, bad):
    """A bad ``fmt`` is a ValueError whose message lists the allowed names and the bad one."""
    with pytest.raises(ValueError) as info:
        call(bad)
    message = str(info.value)
    assert "['e4m3', 'e5m2']" in message
    assert repr(bad) in message


# --------------------------------------------------------------------------------------
# saturating_cast: the one cast to FP8 of the package
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
def test_saturating_cast_matches_the_reference_beyond_r_max_and_at_the_edges(fmt, dtype):
    """Random values of every magnitude, values just past and far past ±R_max, ±inf, ±0:
    the FP8 result (in the format's dtype) is the arithmetic reference, sign of zero
    included; NaN stays NaN."""
    g = torch.Generator().manual_seed(3)
    _, emin, vmax = FORMAT[fmt]
    exps = torch.empty(5000, dtype=torch.float64).uniform_(emin - 6, math.log2(vmax) + 4,
                                                           generator=g)
    signs = torch.where(torch.rand(5000, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    edges = [vmax, vmax * 1.01, vmax * 1.2, vmax * 3, 1e30, math.inf, 0.0]
    x = torch.cat([signs * torch.pow(2.0, exps), torch.tensor(edges, dtype=torch.float64),
                   -torch.tensor(edges, dtype=torch.float64)]).to(torch.float32).to(dtype)
    out = saturating_cast(torch.cat([x, torch.tensor([math.nan], dtype=dtype)]), fmt)
    assert out.dtype == TORCH_DTYPE[fmt]
    value = out.double()
    expected = _reference_round(x.double(), fmt)
    assert torch.equal(value[:-1], expected)
    assert torch.equal(torch.signbit(value[:-1]), torch.signbit(expected))   # -0 stays -0
    assert value[-1].isnan()
    assert value.abs().nan_to_num(0.0).max() == vmax                        # no ±inf


def test_saturating_cast_clamps_where_the_bare_e5m2_cast_overflows():
    """The explicit reference: ±61440 and beyond become ±57344 (the bare cast gives ±inf),
    -1e6 and -inf too; nothing is clamped at a bound of the wrong sign."""
    x = torch.tensor([61440.0, 1e6, math.inf, -61440.0, -1e6, -math.inf, -3.0])
    assert torch.isinf(x[:3].to(torch.float8_e5m2).float()).all()
    out = saturating_cast(x, "e5m2").float()
    assert torch.equal(out, torch.tensor([57344.0] * 3 + [-57344.0] * 3 + [-3.0]))


# --------------------------------------------------------------------------------------
# quantize_dequantize
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", FMTS)
def test_round_trip_of_representable_values_is_exact(fmt, dtype):
    """All finite FP8 values (both signs, subnormals, ±R_max, ±0) survive the round trip."""
    values = _all_finite_fp8_values(fmt).to(dtype)
    assert values.numel() == (254 if fmt == "e4m3" else 248)   # 256 minus NaNs (and ±inf)
    out = quantize_dequantize(values, fmt)
    assert out.dtype == dtype
    assert torch.equal(out, values)
    assert torch.equal(torch.signbit(out), torch.signbit(values))    # -0.0 stays -0.0


@pytest.mark.parametrize("fmt", FMTS)
def test_rounding_matches_round_to_nearest_even_reference(fmt):
    """Random float32 values over the whole range (incl. subnormals and ties) round like the
    arithmetic reference, bit for bit."""
    g = torch.Generator().manual_seed(1)
    mant_bits, emin, vmax = FORMAT[fmt]
    log2_max = math.log2(vmax)
    exps = torch.empty(20000, dtype=torch.float64).uniform_(emin - mant_bits - 3, log2_max,
                                                            generator=g)
    signs = torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    x = (signs * torch.pow(2.0, exps)).to(torch.float32)
    # exact midpoints between neighbouring FP8 values: the ties-to-even cases
    grid = _all_finite_fp8_values(fmt).unique()
    grid = grid[(grid > 0) & (grid < vmax)]
    ties = ((grid[:-1] + grid[1:]) / 2).to(torch.float32)
    x = torch.cat([x, ties, -ties])
    assert torch.equal(quantize_dequantize(x, fmt).double(), _reference_round(x.double(), fmt))


def test_e4m3_ties_round_to_even_mantissa():
    """Midpoints go to the neighbour with an even mantissa: 1+1/16 -> 1, 1+3/16 -> 1.25."""
    x = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10])
    expected = torch.tensor([1.0, 1.25, 16.0, 20.0, 0.0, 2.0 ** -8])
    assert torch.equal(quantize_dequantize(x, "e4m3"), expected)


def test_e4m3_relative_error_is_at_most_unit_roundoff_for_normal_values():
    """Over the normal range [2^-6, 448] of e4m3 (3 mantissa bits), |Q(x) - x| <= 2^-4 |x|,
    and the bound is approached (the quantizer really rounds)."""
    g = torch.Generator().manual_seed(2)
    x = torch.pow(2.0, torch.empty(50000, dtype=torch.float64).uniform_(-6, math.log2(448),
                                                                       generator=g))
    x = torch.cat([x, -x]).to(torch.float32)
    rel = ((quantize_dequantize(x, "e4m3").double() - x.double()).abs() / x.double().abs())
    assert rel.max().item() <= 2.0 ** -4
    assert rel.max().item() > 0.9 * 2.0 ** -4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_e4m3_saturates_at_448_including_infinity(dtype):
    """torch 2.13 casts out-of-range values (and ±inf) to ±448 for e4m3fn; NaN stays NaN."""
    x = torch.tensor([449.0, 464.0, 480.0, 1000.0, 1e30, math.inf, -1000.0, -math.inf, math.nan],
                     dtype=dtype)
    out = quantize_dequantize(x, "e4m3")
    assert torch.equal(out[:-1], torch.tensor([448.0] * 6 + [-448.0] * 2, dtype=dtype))
    assert out[-1].isnan()


def test_e5m2_saturates_like_e4m3():
    """torch 2.13's own e5m2 cast overflows to ±inf from 61440 up; ``quantize_dequantize``
    clamps first, so e5m2 saturates at ±57344 like e4m3 (1000 is in range: 1024)."""
    x = torch.tensor([1000.0, 57344.0, 60000.0, 61439.0, 61440.0, 1e6, math.inf, -1e6, -60000.0])
    raw = x.to(torch.float8_e5m2).float()
    assert torch.isinf(raw[4:7]).all()              # what the bare cast does
    out = quantize_dequantize(x, "e5m2")
    expected = torch.tensor([1024.0, 57344.0, 57344.0, 57344.0, 57344.0, 57344.0, 57344.0,
                             -57344.0, -57344.0])
    assert torch.equal(out, expected)


def test_fake_quantize_of_a_huge_logit_saturates_instead_of_cancelling():
    """A straight-through ``S + (Q(S) − S).detach()`` cancels to 0 at S = 1e10."""
    out = fake_quantize_logits(torch.tensor([1e10, -1e10]), torch.tensor(1.0))
    assert torch.equal(out, torch.tensor([448.0, -448.0]))


# --------------------------------------------------------------------------------------
# fake_quantize_logits
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("divisor", [1.0, 0.01, 3.7, 2.0 ** -9])
def test_fake_quantize_forward_is_q_of_s_over_d_times_d(fmt, divisor):
    """Forward value equals Q(S/d)·d, bit for bit, with Q the reference rounding and d a scalar
    tensor (S/d spans normals and subnormals; saturation has its own test)."""
    logits = torch.randn(2, 3, 8, 8) * 50 * divisor
    d = torch.tensor(divisor)
    scaled = logits / d                                  # the same float32 division
    expected = _reference_round(scaled.double(), fmt).to(torch.float32) * d
    assert torch.isfinite(expected).all()                # e5m2 would overflow to inf otherwise
    out = fake_quantize_logits(logits, d, fmt)
    assert out.dtype == logits.dtype
    assert torch.equal(out, expected)
    assert not torch.equal(out, logits)                  # it did quantize


def test_fake_quantize_saturates_large_logits_at_r_max_times_divisor():
    """A logit of 1000·d maps to 448·d for e4m3 (the saturating cast, then the rescale)."""
    d = torch.tensor(0.25)
    out = fake_quantize_logits(torch.tensor([1000.0, -1000.0, 2000.0]) * d, d, "e4m3")
    assert torch.equal(out, torch.tensor([448.0, -448.0, 448.0]) * d)


@pytest.mark.parametrize("fmt", FMTS)
def test_fake_quantize_gradient_is_identity(fmt):
    """Straight-through estimator: the Jacobian w.r.t. the logits is exactly the identity,
    even for saturated entries, and no gradient reaches the divisor."""
    logits = torch.tensor([[0.3, -1.7, 20.0], [5000.0, -0.01, 7.3]], dtype=torch.float64,
                          requires_grad=True)
    divisor = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    jac = torch.autograd.functional.jacobian(lambda s: fake_quantize_logits(s, divisor, fmt),
                                             logits)
    assert torch.equal(jac.reshape(6, 6), torch.eye(6, dtype=torch.float64))

    weights = torch.randn(2, 3, dtype=torch.float64)
    out = fake_quantize_logits(logits, divisor, fmt)
    grad_logits, grad_divisor = torch.autograd.grad((out * weights).sum(), (logits, divisor),
                                                    allow_unused=True)
    assert torch.equal(grad_logits, weights)
    assert grad_divisor is None


def test_fake_quantize_per_head_divisor_broadcasts_over_heads():
    """A (H, 1, 1) divisor scales head h of (B, H, L, L') logits by d[h]: each head's result
    equals fake quantization of that head alone with the scalar d[h]."""
    B, H, L = 2, 4, 8
    logits = torch.randn(B, H, L, L) * 3
    d = torch.tensor([2.0 ** -9, 0.01, 1.0, 16.0])   # saturating, normal, normal, subnormal
    out = fake_quantize_logits(logits, d.reshape(H, 1, 1), "e4m3")
    assert out.shape == logits.shape
    for h in range(H):
        expected = (_reference_round((logits[:, h] / d[h]).double(), "e4m3").to(torch.float32)
                    * d[h])
        assert torch.equal(out[:, h], expected)
        assert torch.equal(out[:, h], fake_quantize_logits(logits[:, h], d[h], "e4m3"))
    # the heads really are scaled differently: head 0 saturates at 448·2^-9 = 0.875
    assert out[:, 0].abs().max().item() == 448.0 * 2.0 ** -9


def test_fake_quantize_casts_divisor_to_logit_dtype():
    """A float32 divisor applied to float64 logits gives float64 output equal to Q(S/d)·d."""
    logits = torch.randn(4, 5, dtype=torch.float64) * 10
    d = torch.tensor([0.1], dtype=torch.float32)
    d64 = d.to(torch.float64)
    out = fake_quantize_logits(logits, d, "e4m3")
    assert out.dtype == torch.float64
    assert torch.equal(out, _reference_round(logits / d64, "e4m3") * d64)


# --------------------------------------------------------------------------------------
# scaled_abs_max and overflowed
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduce_dims, expected_shape", [((-2, -1), (2, 3)),
                                                          ((0, -2, -1), (3,)),
                                                          ((0, 1, 2, 3), ())])
def test_scaled_abs_max_reduces_abs_over_dims(reduce_dims, expected_shape):
    """max |S|/d over the given dims, per-head divisor (H,1,1), negative extremes counted,
    and the result carries no autograd history."""
    logits = torch.randn(2, 3, 5, 7, requires_grad=True)
    with torch.no_grad():
        logits[1, 2, 4, 6] = -100.0                      # largest |S| is negative
    d = torch.tensor([1.0, 2.0, 4.0])
    out = scaled_abs_max(logits, d.reshape(3, 1, 1), reduce_dims)
    ref = logits.detach().double().abs() / d.double().reshape(3, 1, 1)
    for dim in sorted((x % 4 for x in reduce_dims), reverse=True):
        ref = ref.max(dim=dim).values
    assert out.shape == expected_shape
    assert not out.requires_grad
    assert torch.allclose(out.double(), ref, rtol=1e-7, atol=0)
    if expected_shape == (2, 3):
        assert out[1, 2].item() == 25.0


@pytest.mark.parametrize("fmt", FMTS)
def test_overflowed_boundary_at_r_max_times_one_plus_rtol(fmt):
    """Exactly R_max and R_max·(1+rtol) are not overflows (current-scaling rounding slack);
    just above R_max·(1+rtol) is; checked on float32 and float64 statistics."""
    assert OVERFLOW_RTOL == 1e-5
    r_max = FORMAT[fmt][2]
    edge = r_max * (1.0 + OVERFLOW_RTOL)
    for dtype in (torch.float32, torch.float64):
        # 1e-6 relative is > 10 float32 ulps at these magnitudes, so each side stays put
        values = torch.tensor([0.0, r_max, edge * (1 - 1e-6), edge * (1 + 1e-6), 2 * r_max,
                               math.inf], dtype=dtype)
        expected = torch.tensor([False, False, False, True, True, True])
        assert torch.equal(overflowed(values, fmt), expected)
    assert not overflowed(torch.tensor(edge, dtype=torch.float64), fmt).item()


def test_overflowed_uses_the_format_range():
    """1000 overflows e4m3 (R_max 448) but not e5m2 (R_max 57344); shape is kept."""
    values = torch.tensor([[1000.0, 400.0], [60000.0, 50000.0]])
    assert torch.equal(overflowed(values, "e4m3"), torch.tensor([[True, False], [True, True]]))
    assert torch.equal(overflowed(values, "e5m2"), torch.tensor([[False, False], [True, False]]))
