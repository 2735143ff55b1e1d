"""Unit tests for ``geoscale_fx.kernels.logit_attention``: fused (flex_attention) and explicit attention.

References are independent of the code under test: ``F.scaled_dot_product_attention`` in
float64 when nothing is quantized, and ``_reference_attention`` (float64, written out below)
when a divisor is applied.

Tolerances. Without quantization the code computes in float32 and the reference in float64,
so they agree to ~1e-7 relative; we allow 1e-5. With quantization a float32 logit that differs
from the float64 one by one ulp can land on the other side of an FP8 rounding midpoint and move
by a whole FP8 step (~6 % of the logit), so "same rounding" is guaranteed by construction
instead: q and k are multiples of 1/8 in [-1, 1] and the softmax scale and divisors are powers
of two, so ``S = s·q kᵀ`` and ``S/d`` are exact in float32 (≤ 11 significant bits) and both sides
round identical values. The remaining difference is float32 softmax/matmul rounding: 1e-5.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from geoscale_fx.kernels.logit_attention import explicit_attention, fused_attention, head_divisor

B, H, D = 2, 4, 16
RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------

def _qkv(L, Lk, n_kv=H, dyadic=False, dtype=torch.float32):
    """q (B, H, L, D), k and v (B, n_kv, Lk, D); dyadic q, k are exact multiples of 1/8."""
    if dyadic:
        q = torch.randint(-8, 9, (B, H, L, D)).to(dtype) / 8
        k = torch.randint(-8, 9, (B, n_kv, Lk, D)).to(dtype) / 8
    else:
        q, k = torch.randn(B, H, L, D, dtype=dtype), torch.randn(B, n_kv, Lk, D, dtype=dtype)
    return q, k, torch.randn(B, n_kv, Lk, D, dtype=dtype)


def _bool_mask(shape):
    """Random keep-mask with key 0 always kept, so that no row is fully masked."""
    m = torch.rand(shape) < 0.6
    m[..., 0] = True
    return m


def _float_mask(shape):
    """Additive mask: finite biases plus some -inf entries (key 0 always finite)."""
    m = torch.randn(shape)
    m = m.masked_fill(torch.rand(shape) < 0.3, -math.inf)
    m[..., 0] = 0.5
    return m


def _key_padding_mask(Lk):
    """(B, 1, 1, Lk) bool mask: batch 1 pads its last 3 keys."""
    m = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
    m[1, ..., -3:] = False
    return m


# name -> (L, Lk, n_kv, mask factory (L, Lk) -> mask or None, is_causal, softmax_scale)
CASES = {
    "plain_rectangular": (8, 12, H, None, False, None),
    "bool_mask_2d": (8, 12, H, lambda L, Lk: _bool_mask((L, Lk)), False, None),
    "bool_mask_4d": (8, 8, H, lambda L, Lk: _bool_mask((B, H, L, Lk)), False, None),
    "bool_key_padding": (8, 12, H, lambda L, Lk: _key_padding_mask(Lk), False, None),
    "float_mask": (8, 12, H, lambda L, Lk: _float_mask((B, 1, L, Lk)), False, None),
    "causal_square": (12, 12, H, None, True, None),
    "causal_top_left": (8, 12, H, None, True, None),
    "gqa": (8, 12, 2, None, False, None),
    "gqa_bool_mask": (8, 8, 2, lambda L, Lk: _bool_mask((B, 1, L, Lk)), False, None),
    "custom_scale": (8, 12, H, None, False, 0.37),
}


def _case(name, dyadic=False):
    L, Lk, n_kv, make_mask, is_causal, scale = CASES[name]
    q, k, v = _qkv(L, Lk, n_kv, dyadic=dyadic)
    mask = make_mask(L, Lk) if make_mask else None
    return dict(q=q, k=k, v=v, attn_mask=mask, is_causal=is_causal,
                softmax_scale=D ** -0.5 if scale is None else scale, enable_gqa=n_kv != H)


def _run(impl, case, divisor, fmt="e4m3"):
    """Call fused or explicit attention on a case dict with a fixed divisor (or None)."""
    c = case
    if impl == "fused":
        return fused_attention(c["q"], c["k"], c["v"], c["attn_mask"], divisor,
                               softmax_scale=c["softmax_scale"], is_causal=c["is_causal"],
                               enable_gqa=c["enable_gqa"], fmt=fmt)
    return explicit_attention(c["q"], c["k"], c["v"], c["attn_mask"],
                              softmax_scale=c["softmax_scale"], is_causal=c["is_causal"],
                              enable_gqa=c["enable_gqa"], dropout_p=0.0, fmt=fmt,
                              divisor_of=lambda logits: divisor)


def _sdpa64(case):
    """F.scaled_dot_product_attention in float64 (no quantization)."""
    c, f64 = case, torch.float64
    mask = c["attn_mask"]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(f64)
    return F.scaled_dot_product_attention(c["q"].to(f64), c["k"].to(f64), c["v"].to(f64),
                                          attn_mask=mask, is_causal=c["is_causal"],
                                          scale=c["softmax_scale"], enable_gqa=c["enable_gqa"])


def _reference_attention(case, divisor, fmt="e4m3"):
    """float64 softmax(M(Q(S/d)·d)) V, S = s·q kᵀ, d one value or one per query head."""
    c, f64 = case, torch.float64
    q, k, v = c["q"].to(f64), c["k"].to(f64), c["v"].to(f64)
    if c["enable_gqa"]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = c["softmax_scale"] * (q @ k.transpose(-2, -1))
    if divisor is not None:
        d = divisor.to(f64).expand(q.shape[1]).reshape(-1, 1, 1)
        fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
        limit = torch.finfo(fp8).max          # saturating (torch < 2.13's cast gives NaN)
        s = (s / d).clamp(-limit, limit).to(fp8).to(f64) * d
    mask = c["attn_mask"]
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.to(f64)
    if c["is_causal"]:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, dim=-1) @ v


# per-query-head divisors covering all regimes of e4m3 for logits of magnitude ~0.1..4:
# saturating (2^-9: 448·2^-9 = 0.875), normal (2^-3, 1) and subnormal (16)
PER_HEAD = torch.tensor([2.0 ** -9, 2.0 ** -3, 1.0, 16.0])
SCALAR = torch.tensor([2.0 ** -3])


# --------------------------------------------------------------------------------------
# head_divisor
# --------------------------------------------------------------------------------------

def test_head_divisor_expands_a_single_scale_to_every_head():
    """A (1,) divisor becomes (H, 1, 1) with the same value in every head."""
    out = head_divisor(torch.tensor([0.5]), 4)
    assert out.shape == (4, 1, 1)
    assert torch.equal(out, torch.full((4, 1, 1), 0.5))


def test_head_divisor_keeps_per_head_scales_in_order():
    """A (H,) divisor becomes (H, 1, 1), head h holding d[h]; it broadcasts over (B, H, L, L')."""
    d = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = head_divisor(d, 4)
    assert out.shape == (4, 1, 1)
    assert torch.equal(out.flatten(), d)
    assert torch.equal((torch.ones(2, 4, 3, 5) * out)[1, :, 2, 4], d)


def test_head_divisor_rejects_a_wrong_number_of_scales():
    """Three scales for four heads is an error, not a silent broadcast."""
    with pytest.raises(RuntimeError):
        head_divisor(torch.tensor([1.0, 2.0, 3.0]), 4)


# --------------------------------------------------------------------------------------
# no quantization: both paths are plain SDPA
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("impl", ["fused", "explicit"])
def test_without_divisor_matches_float64_sdpa(impl, case_name):
    """divisor None (fused) / divisor_of -> None (explicit) is exactly SDPA semantics: bool and
    additive masks, top-left is_causal, enable_gqa, custom scale."""
    case = _case(case_name)
    out = _run(impl, case, None)
    ref = _sdpa64(case)
    assert out.shape == ref.shape == (B, H, case["q"].shape[2], D)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)


def test_fused_broadcasts_a_single_key_head_as_sdpa_does():
    """Multi-query attention written without enable_gqa (Falcon): SDPA broadcasts the one
    key/value head over the query heads; the fused lowering does the same."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k, v = (torch.randn(2, 1, 7, 8, generator=gen) for _ in range(2))
    out = fused_attention(q, k, v, None, None, softmax_scale=8 ** -0.5, is_causal=False,
                          enable_gqa=False, fmt="e4m3")
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_causal_is_top_left_aligned_for_rectangular_scores():
    """With L=8 < L'=12, query 0 attends to key 0 only (top-left), so its output is v[..., 0, :]
    in both paths (a bottom-right causal mask would let it see keys 0..4)."""
    case = _case("causal_top_left")
    for impl in ("fused", "explicit"):
        out = _run(impl, case, None)
        torch.testing.assert_close(out[:, :, 0], case["v"][:, :, 0], rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------
# with a divisor: the FP8 round trip of S / d
# --------------------------------------------------------------------------------------

QUANT_CASES = ["plain_rectangular", "bool_mask_2d", "float_mask", "causal_top_left", "gqa"]


@pytest.mark.parametrize("case_name, divisor",
                         [(name, PER_HEAD) for name in QUANT_CASES]
                         + [("plain_rectangular", SCALAR), ("gqa", SCALAR)],
                         ids=[f"{name}-per_head" for name in QUANT_CASES]
                         + ["plain_rectangular-scalar", "gqa-scalar"])
@pytest.mark.parametrize("impl", ["fused", "explicit"])
def test_with_divisor_matches_float64_quantized_reference(impl, case_name, divisor):
    """softmax(M(Q(S/d)·d)) V against the float64 reference with the same FP8 rounding
    (dyadic inputs, see the module docstring); the quantization visibly changes the output."""
    case = _case(case_name, dyadic=True)
    out = _run(impl, case, divisor)
    ref = _reference_attention(case, divisor)
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    assert (ref - _reference_attention(case, None)).abs().max().item() > 1e-3


@pytest.mark.parametrize("impl", ["fused", "explicit"])
def test_per_head_divisor_is_applied_to_its_own_head(impl):
    """Head h uses d[h]: with the divisors rolled by two heads the output changes in every head
    and matches the reference for the rolled divisors. (Rolling by two pairs each head with a
    divisor from another regime; two normal-regime powers of two, e.g. 1 and 2^-3, would give
    identical results since FP8 rounding is invariant under power-of-two scaling.)"""
    case = _case("plain_rectangular", dyadic=True)
    out = _run(impl, case, PER_HEAD)
    rolled = _run(impl, case, PER_HEAD.roll(2))
    torch.testing.assert_close(rolled.double(), _reference_attention(case, PER_HEAD.roll(2)),
                               rtol=RTOL, atol=ATOL)
    per_head_change = (out - rolled).abs().amax(dim=(0, 2, 3))
    assert (per_head_change > 1e-3).all()


@pytest.mark.parametrize("impl", ["fused", "explicit"])
def test_e5m2_format_is_used_when_asked(impl):
    """fmt='e5m2' rounds to 2 mantissa bits: matches the e5m2 reference and differs from e4m3."""
    case = _case("plain_rectangular", dyadic=True)
    d = torch.tensor([2.0 ** -3])
    out = _run(impl, case, d, fmt="e5m2")
    torch.testing.assert_close(out.double(), _reference_attention(case, d, "e5m2"),
                               rtol=RTOL, atol=ATOL)
    assert (out.double() - _reference_attention(case, d, "e4m3")).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------
# explicit_attention specifics
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_explicit_divisor_of_sees_float32_unmasked_logits(dtype):
    """divisor_of is called once with the (B, H_q, L, L') float32 logits s·q kᵀ (GQA keys
    expanded per query head), before the causal mask (all entries finite)."""
    L, Lk, n_kv, scale = 8, 12, 2, 0.37
    q, k, v = _qkv(L, Lk, n_kv, dtype=dtype)
    seen = []

    def divisor_of(logits):
        seen.append(logits.detach().clone())
        return None

    explicit_attention(q, k, v, None, softmax_scale=scale, is_causal=True, enable_gqa=True,
                       dropout_p=0.0, fmt="e4m3", divisor_of=divisor_of)
    assert len(seen) == 1
    logits = seen[0]
    assert logits.shape == (B, H, L, Lk)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    k_per_q_head = k.double().repeat_interleave(H // n_kv, dim=1)
    expected = scale * (q.double() @ k_per_q_head.transpose(-2, -1))
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-6)


def test_explicit_divisor_of_result_is_used_for_quantization():
    """The divisor divisor_of returns (computed from the logits: per-head current scaling,
    rounded up to a power of two) is the one the quantizer uses: the output matches the
    reference quantized with that divisor."""
    case = _case("plain_rectangular", dyadic=True)
    returned = []

    def current_scaling(logits):
        d = logits.abs().amax(dim=(0, 2, 3)) / 448.0     # one scale per head
        d = torch.exp2(torch.ceil(torch.log2(d)))          # power of two keeps S/d exact
        returned.append(d)
        return d

    c = case
    out = explicit_attention(c["q"], c["k"], c["v"], None, softmax_scale=c["softmax_scale"],
                             is_causal=False, enable_gqa=False, dropout_p=0.0, fmt="e4m3",
                             divisor_of=current_scaling)
    assert returned[0].shape == (H,)
    torch.testing.assert_close(out.double(), _reference_attention(case, returned[0]),
                               rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------
# fused vs explicit
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("divisor", [torch.tensor([0.011, 0.02, 0.005, 0.3]),
                                     torch.tensor([0.013])], ids=["per_head", "scalar"])
@pytest.mark.parametrize("case_name", ["custom_scale", "causal_top_left", "gqa_bool_mask"])
def test_fused_and_explicit_agree_with_a_divisor(case_name, divisor):
    """On Gaussian inputs with non-power-of-two scale and divisors, the two paths agree: both
    form S = (q kᵀ)·s with the same float32 operations, so they quantize identical values."""
    case = _case(case_name)
    fused = _run("fused", case, divisor)
    explicit = _run("explicit", case, divisor)
    torch.testing.assert_close(fused, explicit, rtol=RTOL, atol=ATOL)
    assert (fused - _run("explicit", case, None)).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------
# fully masked rows
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", [
    "fused",
    "explicit",
])
def test_fully_masked_row_gives_zeros_like_sdpa(impl):
    """A query row whose keys are all masked out gives a zero output row, as in SDPA (torch
    2.13 uses a safe softmax there); the other rows are unaffected."""
    case = _case("bool_mask_2d")
    case["attn_mask"][3] = False
    ref = _sdpa64(case)
    assert torch.equal(ref[:, :, 3], torch.zeros_like(ref[:, :, 3]))
    out = _run(impl, case, SCALAR)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))


def test_the_fused_score_mod_passes_the_gradient_straight_through(monkeypatch):
    """flex_attention's backward (CUDA only) differentiates the score_mod: its FP8 round trip
    must have the straight-through gradient of the explicit lowering — dS unrounded, also
    where S / scale saturates — while its value is the round trip."""
    from geoscale_fx.kernels import logit_attention

    seen = {}

    def capture(q, k, v, *, score_mod, **kwargs):
        seen["score_mod"] = score_mod
        return q

    monkeypatch.setattr(logit_attention, "flex_attention", capture)
    q = torch.randn(1, 2, 4, 8)
    divisor = torch.tensor([2.0 ** -9, 1.0])            # head 0 saturates above 0.875
    fused_attention(q, q, q, None, divisor, softmax_scale=1.0, is_causal=False,
                    enable_gqa=False, fmt="e4m3")
    score = torch.tensor([0.1, 3.0, -50.0, 1e-3], dtype=torch.float64, requires_grad=True)
    idx = torch.zeros((), dtype=torch.long)
    for head in (0, 1):
        out = seen["score_mod"](score, idx, torch.tensor(head), idx, idx)
        d = float(divisor[head])
        limit = torch.finfo(torch.float8_e4m3fn).max
        expected = (score.detach() / d).clamp(-limit, limit).to(torch.float8_e4m3fn).double() * d
        assert torch.equal(out.detach(), expected)      # the same cast, the same value
        grad, = torch.autograd.grad(out.sum(), score)
        assert torch.equal(grad, torch.ones_like(score)), head
