"""``geoscale_fx.core.nvfp4`` and ``kv_cache="nvfp4"``: an emulated NVFP4 KV cache.

The numerics are checked against a float64 reference of the format written here: the E2M1
grid enumerated explicitly, nearest value with ties to the even code, block scales
amax / 6 / s_g rounded float64 → float32 → E4M3 by torch's own cast. The certified global scale
bound / (6 · 448) is checked on adversarial blocks at the bound (never an overflowing block
scale, and a negative twin that does overflow), and ``generate`` with the NVFP4 cache stays
close to the unquantized model."""
from __future__ import annotations

import pytest
import torch

import geoscale_fx
from geoscale_fx.core import nvfp4
from tests.hf_models import (build_hf, cache_bytes, generate_with_logits, kv_cache_runs,
                             plain_cache, prompt)

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _ref_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid value of |x| (saturating at 6), the even index on a tie, x's sign."""
    distance = (x.abs().clamp(max=6.0).unsqueeze(-1) - E2M1_GRID).abs()   # (..., 8)
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    even = (torch.arange(8) % 2 == 0).double()
    index = (nearest.double() * (1.0 + even)).argmax(dim=-1)              # even wins a tie
    return torch.copysign(E2M1_GRID[index], x)


def _ref_quantize(x: torch.Tensor, s_g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(q (..., d), s_b (..., d/16), x̂ (..., d))`` of NVFP4 with global scale s_g."""
    x = x.double()
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    s_g = torch.as_tensor(s_g, dtype=torch.float64)
    ratio = blocks.abs().amax(dim=-1) / 6.0 / s_g
    s_b = ratio.float().clamp(max=448.0).to(torch.float8_e4m3fn).double()
    divisor = (s_b * s_g).unsqueeze(-1)
    q = _ref_e2m1(torch.where(divisor > 0, blocks / divisor, torch.zeros_like(blocks)))
    return q.reshape(x.shape), s_b, (q * divisor).reshape(x.shape)


def _decode(codes: torch.Tensor) -> torch.Tensor:
    """float64 value of each 4-bit code: the grid at bits 0..2, negated by bit 3."""
    magnitude = E2M1_GRID[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def _check_against_reference(x: torch.Tensor, s_g) -> tuple[torch.Tensor, torch.Tensor]:
    s_g = torch.as_tensor(s_g, dtype=torch.float32)
    codes, scale_bits = nvfp4.quantize(x, s_g)
    q, s_b, x_hat = _ref_quantize(x, s_g)
    assert codes.dtype == scale_bits.dtype == torch.uint8
    assert torch.equal(scale_bits.view(torch.float8_e4m3fn).double(), s_b)
    assert torch.equal(_decode(codes), q)
    # q · s_b · s_g: s_b · s_g and the product with q each round once in float32
    torch.testing.assert_close(nvfp4.dequantize(codes, scale_bits, s_g).double(), x_hat,
                               rtol=3e-7, atol=0.0)
    assert torch.equal(nvfp4.unpack(nvfp4.pack(codes, scale_bits), x.shape[-1])[0], codes)
    return q, s_b


def test_e2m1_rounding_on_every_tie_and_past_the_saturation():
    """A block with max 6 and s_g = 1 has s_b = 1: x / (s_b · s_g) is x itself."""
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                      -0.25, -0.75, -1.75, -5.0, 5.01, 0.2, 2.9, 4.9])
    q, s_b = _check_against_reference(x, 1.0)
    assert torch.equal(s_b, torch.ones(1, dtype=torch.float64))
    assert q.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0,
                          -0.0, -1.0, -2.0, -4.0, 6.0, 0.0, 3.0, 4.0]
    saturated = torch.tensor([6.0, 7.0, -100.0, 1e30] + [0.0] * 12)
    assert nvfp4.round_e2m1(saturated)[:4].tolist() == [6.0, 6.0, -6.0, 6.0]


def test_random_blocks_of_many_magnitudes_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 7, 64, generator=gen)                          # (B, H, T, d)
    magnitude = 10.0 ** (8 * torch.rand(3, 2, 7, 4, 1, generator=gen) - 4)  # per block
    x = (x.view(3, 2, 7, 4, 16) * magnitude).view(3, 2, 7, 64)
    per_head = nvfp4.global_scale(x.abs().amax(dim=(0, 2, 3)).double()).view(1, 2, 1, 1)
    for s_g in (per_head, nvfp4.global_scale(x.abs().amax().double()), 1.0):
        _check_against_reference(x, s_g)


@pytest.mark.parametrize("case", ["zeros", "all_equal", "at_bound", "negative", "tiny_blocks",
                                  "subnormal_scale", "overflowing_scale"])
def test_edge_cases_match_the_reference(case):
    bound = torch.tensor(3.7, dtype=torch.float64)
    s_g = nvfp4.global_scale(bound)
    gen = torch.Generator().manual_seed(1)
    if case == "zeros":
        x = torch.zeros(2, 32)
    elif case == "all_equal":
        x = torch.full((2, 16), 0.37)
    elif case == "at_bound":
        signs = torch.where(torch.rand(2, 32, generator=gen) < 0.5, -1.0, 1.0)
        x = signs * _largest_float32_at_most(bound)
    elif case == "negative":
        x = -torch.rand(2, 32, generator=gen) * bound.float()
    elif case == "tiny_blocks":       # block 0 normal, block 1 far below: its scale is 0
        x = torch.cat([torch.randn(16, generator=gen), 1e-9 * torch.randn(16, generator=gen)])
    elif case == "subnormal_scale":   # amax / 6 / s_g = 2^-8: a subnormal but exact E4M3 scale
        x = torch.linspace(-1.0, 1.0, 16) * (6 * 2.0 ** -8)
        s_g = torch.tensor(1.0)
    else:                             # s_g far too small: the scale saturates, q clips at ±6
        x = torch.randn(16, generator=gen) * 100
        s_g = torch.tensor(1e-4)
    q, s_b = _check_against_reference(x, s_g)
    x_hat = nvfp4.fake_quantize(x, s_g)
    assert bool(x_hat.isfinite().all())
    if case == "zeros":
        assert not x_hat.any() and not s_b.any()
    elif case == "all_equal":
        assert bool((q == 6).all())
        torch.testing.assert_close(x_hat, x, rtol=2.0 ** -4, atol=0.0)   # one E4M3 rounding
    elif case == "at_bound":
        assert bool((s_b == 448).all()) and bool((q.abs() == 6).all())
        assert bool((x_hat.abs().double() >= bound).all())
        torch.testing.assert_close(x_hat.abs().double(), bound.expand(2, 32), rtol=2e-6, atol=0)
    elif case == "negative":
        assert bool((q <= 0).all()) and bool((x_hat <= 0).all())
    elif case == "tiny_blocks":
        assert s_b[0] > 0 and s_b[1] == 0 and not x_hat[16:].any()
    elif case == "subnormal_scale":
        assert s_b.item() == 2.0 ** -8
        assert nvfp4.scale_range_counts(nvfp4.block_scale_ratio(x, s_g)).tolist() == [0, 1]
    else:
        assert s_b.item() == 448 and bool((q.abs() == 6).any())
        assert nvfp4.scale_range_counts(nvfp4.block_scale_ratio(x, s_g)).tolist() == [1, 0]


def test_packing_takes_4_5_bits_per_entry_and_refuses_ragged_blocks():
    codes, scale_bits = nvfp4.quantize(torch.randn(5, 128), torch.tensor(0.01))
    packed = nvfp4.pack(codes, scale_bits)
    assert packed.shape == (5, nvfp4.packed_width(128)) == (5, 72)     # 128 · 4.5 / 8
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.randn(4, 24), torch.tensor(1.0))


def _largest_float32_at_most(bound: torch.Tensor) -> torch.Tensor:
    y = bound.float()
    return torch.where(y.double() > bound, torch.nextafter(y, torch.zeros_like(y)), y)


def test_certified_global_scale_never_overflows_a_block_scale_at_the_bound():
    """Bounds over 12 decades; every entry of every block is ±(the largest float32 ≤ B), the
    worst input the bound allows. No block scale exceeds 448, and the scale is tight (the
    block at the bound gets 448: no E4M3 range is wasted). Half the bound overflows all."""
    gen = torch.Generator().manual_seed(2)
    bound = 10.0 ** (12 * torch.rand(4000, generator=gen, dtype=torch.float64) - 6)
    signs = torch.where(torch.rand(4000, 32, generator=gen) < 0.5, -1.0, 1.0)
    x = signs * _largest_float32_at_most(bound).unsqueeze(-1)            # (4000, 32)
    ratio = nvfp4.block_scale_ratio(x, nvfp4.global_scale(bound).unsqueeze(-1))
    assert nvfp4.scale_range_counts(ratio).tolist() == [0, 0]
    assert float(ratio.max()) <= 448.0 and float(ratio.min()) >= 448.0 * (1 - 2.0 ** -17)
    codes, scale_bits = nvfp4.quantize(x, nvfp4.global_scale(bound).unsqueeze(-1))
    assert bool((scale_bits.view(torch.float8_e4m3fn).float() == 448).all())
    too_small = nvfp4.global_scale(bound / 2).unsqueeze(-1)
    assert nvfp4.scale_range_counts(nvfp4.block_scale_ratio(x, too_small)).tolist() == [8000, 0]


def test_a_block_goes_subnormal_only_when_its_amax_is_below_bound_over_28672():
    bound = torch.tensor(17.0, dtype=torch.float64)
    s_g = nvfp4.global_scale(bound)
    threshold = bound / 28672                 # amax / 6 / s_g = 2^-6  ⇔  amax = 6·2^-6·B/2688
    amax = torch.stack([threshold * (1 + 2.0 ** -16), threshold * (1 - 2.0 ** -16)]).float()
    x = amax.view(2, 1) * torch.linspace(-1.0, 1.0, 16).view(1, 16)      # (2 blocks, 16)
    assert nvfp4.scale_range_counts(nvfp4.block_scale_ratio(x, s_g)).tolist() == [0, 1]
    assert float(nvfp4.block_scale_ratio(x, s_g)[0]) >= nvfp4.E4M3_MIN_NORMAL


def test_global_scale_is_the_smallest_safe_float32_and_never_zero():
    amax = torch.tensor([0.0, 1e-30, 1.0, 2688.0, 3.3e6], dtype=torch.float64)
    g = nvfp4.global_scale(amax)
    assert g.dtype == torch.float32 and bool((g > 0).all())
    assert bool((g.double() >= amax / 2688).all())
    torch.testing.assert_close(g[2:].double(), amax[2:] / 2688, rtol=2.0 ** -19, atol=0)


# --- the NVFP4 KV cache in generate -----------------------------------------------------

@pytest.mark.zoo
def test_nvfp4_cache_holds_the_reference_quantization_of_the_first_layer():
    model = build_hf("llama-sdpa")
    ids = prompt()
    reference = plain_cache(model, ids).layers[0]
    wrapped = geoscale_fx.wrap(model, kv_cache="nvfp4", scaling="none", compiler="aot_eager")
    cache = model._geoscale_kv_cache.new_cache(ids)
    with torch.no_grad():
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                         do_sample=False, pad_token_id=0, past_key_values=cache)
    layer = cache.layers[0]
    d = reference.keys.shape[-1]
    assert layer.keys.dtype == torch.uint8 and layer.keys.shape[-1] == nvfp4.packed_width(d)
    # the prompt's positions: same inputs in both runs, and aot_eager replays eager's aten ops,
    # so layer 0's keys are the same bits (as in tests/test_kv_cache.py)
    length = ids.shape[1]
    for packed, s_g, ref in ((layer.keys, layer.k_scale, reference.keys),
                             (layer.values, layer.v_scale, reference.values)):
        codes, scale_bits = nvfp4.unpack(packed[:, :, :length], d)
        q, s_b, _ = _ref_quantize(ref[:, :, :length], s_g.view(1, -1, 1, 1))
        assert torch.equal(_decode(codes), q)
        assert torch.equal(scale_bits.view(torch.float8_e4m3fn).double(), s_b)


@pytest.mark.zoo
@pytest.mark.parametrize("key, cache", [("llama-sdpa", "dynamic"), ("gpt2-sdpa", "dynamic"),
                                        ("qwen2-sdpa", "static")])
def test_nvfp4_generation_stays_close_to_the_unquantized_model(key, cache):
    """First generated token (same prefix in every run), relative L2 of the logits against
    the unquantized model. Measured: 0.110 (llama), 0.022 (gpt2), 0.053 (qwen2); with global
    scales from the observed amax instead 0.102, 0.020, 0.057. E2M1 keeps one mantissa bit,
    so a ~10% logit error on these random-weight models is the format's own, not the scale's:
    the bounds are ≤ 0.15 absolute, and ≤ 1.5× the observed-amax error + 0.01 (NVFP4's
    precision does not depend on s_g while block scales stay normal; what is left is which
    way the E4M3 block scales round, 0.92–1.08× here)."""
    model = build_hf(key)
    runs = kv_cache_runs(model, prompt(), "nvfp4", static=cache == "static")
    ref, observed, ours, wrapped = runs.reference, runs.observed, runs.certified, runs.wrapped

    def error(logits):
        return float(((logits[0] - ref[0]).norm(dim=-1) / ref[0].norm(dim=-1)).max())

    print(f"\n{key} {cache}: first-token relative L2 logit error, certified "
          f"{error(ours):.4f}, observed amax {error(observed):.4f}")
    assert bool(ours.isfinite().all())
    assert 0 < error(ours) <= min(0.15, 1.5 * error(observed) + 0.01)
    rows = wrapped.report().rows
    assert rows and all(r["kv_saturated"] == 0 and r["k_scale"] > 0 for r in rows)
    assert model._geoscale_kv_cache.saturated_total() == 0


@pytest.mark.zoo
def test_nvfp4_cache_takes_9_32_of_the_bytes_of_a_bf16_cache():
    nvfp4_bytes, bf16, logits = cache_bytes(build_hf("llama-sdpa").to(torch.bfloat16), "nvfp4")
    assert bool(logits.isfinite().all()) and logits.dtype == torch.float32
    assert nvfp4_bytes * 32 == bf16 * 9                            # 4.5 bits vs 16 bits


@pytest.mark.zoo
def test_nvfp4_is_named_among_the_allowed_values_and_needs_head_dims_of_16():
    with pytest.raises(ValueError, match="kv_cache='int4'.*'nvfp4'"):
        geoscale_fx.wrap(build_hf("llama-sdpa"), kv_cache="int4")
    wrapped = geoscale_fx.wrap(build_hf("mistral-sdpa"), kv_cache="nvfp4", compiler="aot_eager")
    with pytest.raises(ValueError, match="head dims 8/8 are not multiples of 16"):
        generate_with_logits(wrapped, prompt())
