"""Unit tests for ``geoscale_fx.kv_cache.layers``: Hugging Face cache layers storing FP8/NVFP4.

Built from a config alone (no model). Checked against independent references: the stored bits
are a float64 re-implementation of round-to-nearest-even on the E4M3 grid of ``x / s_h``
(saturating), the returned states are those values times s_h, the saturation count is the
number of entries with ``|x / s_h| ≥ R_max`` counted here, and the bytes are those of uint8
storage.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from geoscale_fx.core import nvfp4
from geoscale_fx.kv_cache.layers import FP8Layer, NVFP4Layer, cache_nbytes, fp8_cache
from geoscale_fx.kv_cache.layer_scales import LayerScales

transformers = pytest.importorskip("transformers")

N_KV, HEAD_DIM, LAYERS = 2, 16, 2


def _config():
    return transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=64,
                                    num_attention_heads=4, num_key_value_heads=N_KV,
                                    intermediate_size=128, vocab_size=128,
                                    max_position_embeddings=64)


def _layers(k_bound: torch.Tensor, v_bound: torch.Tensor) -> list[LayerScales]:
    return [LayerScales(i, f"model.layers.{i}.self_attn", torch.ones(4, dtype=torch.float64),
                        k_bound.double(), v_bound.double()) for i in range(LAYERS)]


def _cache(fmt: str, k_bound=(8.0, 2.0), v_bound=(4.0, 1.0), **kw):
    counters = [torch.zeros(2, dtype=torch.int64) for _ in range(LAYERS)]
    cache = fp8_cache(_config(), _layers(torch.tensor(k_bound), torch.tensor(v_bound)), fmt,
                      counters, **kw)
    return cache, counters


def _states(t: int, amax_per_head=(8.0, 2.0), seed: int = 0) -> torch.Tensor:
    """(1, N_KV, t, HEAD_DIM) float32 with max |entry| of head h at most ``amax_per_head[h]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(1, N_KV, t, HEAD_DIM, generator=g) * 2 - 1
    return x * torch.tensor(amax_per_head).view(1, -1, 1, 1)


def _e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """float64 E4M3 rounding (3 mantissa bits, min normal 2^-6), ties to even, saturating."""
    x = x.double().clamp(-448.0, 448.0)
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -30))).clamp_min(-6)
    step = torch.pow(2.0, exponent - 3)
    return torch.round(x / step) * step


def test_fp8_layer_stores_the_reference_rounding_and_reads_it_back():
    cache, counters = _cache("e4m3")
    layer = cache.layers[0]
    assert isinstance(layer, FP8Layer) and not isinstance(layer, NVFP4Layer)
    keys, values = _states(5, seed=1), _states(5, (4.0, 1.0), seed=2)
    out_k, out_v = cache.update(keys, values, 0)
    assert layer.keys.dtype == torch.uint8 and out_k.dtype == torch.float32
    for stored, out, x, scale in ((layer.keys, out_k, keys, layer.k_scale),
                                  (layer.values, out_v, values, layer.v_scale)):
        s = scale.double().view(1, -1, 1, 1)
        expected = _e4m3_round(x / scale.view(1, -1, 1, 1))      # x / s in float32, as stored
        assert torch.equal(stored.view(torch.float8_e4m3fn).double(), expected)
        assert torch.equal(out, (expected * s).float())
        # within FP8 error of what was written: half an E4M3 ulp (2^-4 relative), plus the
        # subnormal step 2^-10 · s near zero
        assert bool(((out.double() - x.double()).abs() <= x.double().abs() / 16 + s / 1024).all())
    assert counters[0].tolist() == [0, 0] and counters[1].tolist() == [0, 0]


def test_entries_past_the_scale_are_clamped_and_counted():
    cache, counters = _cache("e4m3")
    scale = cache.layers[1].k_scale                                     # s_0 = ⌈8 / 448⌉
    keys = _states(4, seed=3)
    keys[0, 0, 0, :3] = torch.tensor([100.0, -100.0, float("inf")])   # far past 8 = 448 · s_0
    keys[0, 0, 1, :2] = torch.tensor([460.0, -440.0]) * scale[0]      # just past, just under
    values = _states(4, (4.0, 1.0), seed=4)
    out_k, _ = cache.update(keys, values, 1)
    ratio = (keys / scale.view(1, -1, 1, 1)).abs()
    assert counters[1].tolist() == [int((ratio >= 448.0).sum()), 0] == [4, 0]
    assert torch.equal(out_k[0, 0, 0, :3], torch.tensor([448.0, -448.0, 448.0]) * scale[0])
    assert torch.equal(out_k[0, 0, 1, :2], torch.tensor([448.0, -448.0]) * scale[0])
    assert counters[0].tolist() == [0, 0]


def test_a_second_update_appends_and_a_static_cache_holds_max_cache_len():
    cache, _ = _cache("e5m2")
    cache.update(_states(3), _states(3), 0)
    out_k, _ = cache.update(_states(2, seed=5), _states(2, seed=6), 0)
    assert out_k.shape == (1, N_KV, 5, HEAD_DIM)
    static, _ = _cache("e4m3", static=True, max_cache_len=12)
    out_k, _ = static.update(_states(3), _states(3), 0, {"cache_position": torch.arange(3)})
    assert out_k.shape == (1, N_KV, 12, HEAD_DIM)
    assert static.layers[0].keys.dtype == torch.uint8
    with pytest.raises(ValueError, match="max_cache_len"):
        _cache("e4m3", static=True)


def test_nvfp4_layer_stores_packed_rows_within_nvfp4_error():
    cache, counters = _cache("nvfp4")
    assert isinstance(cache.layers[0], NVFP4Layer)
    keys, values = _states(6, seed=7), _states(6, (4.0, 1.0), seed=8)
    out_k, out_v = cache.update(keys, values, 0)
    layer = cache.layers[0]
    assert layer.keys.shape == (1, N_KV, 6, nvfp4.packed_width(HEAD_DIM))
    for out, x, bound in ((out_k, keys, (8.0, 2.0)), (out_v, values, (4.0, 1.0))):
        # E2M1 keeps 2 significant bits: error ≤ 1/4 relative to the block's scale · 6, and
        # the block scale's own E4M3 rounding adds 2^-4
        block_amax = x.reshape(1, N_KV, 6, -1, 16).abs().amax(-1, keepdim=True)
        error = (out - x).reshape(1, N_KV, 6, -1, 16).abs()
        assert bool((error <= block_amax * (0.25 * 1.0625) + 1e-6).all())
        assert float(error.max()) > 0                                # it really quantized
    assert counters[0].tolist() == [0, 0]


def test_head_mismatches_are_refused_by_name():
    cache, _ = _cache("e4m3")
    wrong = torch.zeros(1, 3, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="3 key heads, but 2 k scales"):
        cache.update(wrong, wrong, 0)
    nv, _ = _cache("nvfp4")
    ragged = torch.zeros(1, N_KV, 2, 8)
    with pytest.raises(ValueError, match="not multiples of 16"):
        nv.update(ragged, ragged, 0)
    beyond = replace(_layers(torch.ones(2), torch.ones(2))[0], layer=LAYERS)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' writes cache layer 2, "
                                         r"but the config's cache has no layer there \(2 "
                                         r"layers\)"):
        fp8_cache(_config(), [beyond], "e4m3", [torch.zeros(2, dtype=torch.int64)])


def test_only_the_written_layers_store_fp8_and_a_linear_attention_layer_takes_no_scale():
    """A hybrid's cache (Qwen3-Next: ``layer_types`` linear, full): the scales of the one
    attention layer go to cache layer 1; layer 0 keeps transformers' own
    ``LinearAttentionLayer``; a scale aimed at it is refused by name."""
    config = transformers.Qwen3NextConfig(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        hidden_size=64, num_attention_heads=4, num_key_value_heads=N_KV, head_dim=HEAD_DIM,
        intermediate_size=128, vocab_size=128)
    full = replace(_layers(torch.tensor([8.0, 2.0]), torch.tensor([4.0, 1.0]))[1])
    cache = fp8_cache(config, [full], "e4m3", [torch.zeros(2, dtype=torch.int64)])
    assert type(cache.layers[0]).__name__ == "LinearAttentionLayer"
    assert isinstance(cache.layers[1], FP8Layer)
    keys = _states(4)
    got, _ = cache.update(keys, keys, 1)
    ref = torch.tensor([8.0, 2.0], dtype=torch.float64) / 448
    scale = cache.layers[1].k_scale.double()
    assert bool((scale >= ref).all()) and bool((scale - ref < ref * 2.0 ** -23).all())
    assert (got - keys).abs().max() <= 2.0 ** -4 * 8.0          # one E4M3 step of head 0
    linear = replace(full, layer=0)
    with pytest.raises(ValueError, match="writes cache layer 0, but the config's cache has "
                                         "LinearAttentionLayer there"):
        fp8_cache(config, [linear], "e4m3", [torch.zeros(2, dtype=torch.int64)])


def test_cache_nbytes_counts_one_byte_per_fp8_entry():
    cache, _ = _cache("e4m3")
    assert cache_nbytes(cache) == 0
    cache.update(_states(5), _states(5), 0)
    cache.update(_states(3), _states(3), 1)
    assert cache_nbytes(cache) == 2 * N_KV * HEAD_DIM * (5 + 3)
    nv, _ = _cache("nvfp4")
    nv.update(_states(4), _states(4), 0)
    assert cache_nbytes(nv) == 2 * N_KV * 4 * (HEAD_DIM // 2 + HEAD_DIM // 16)


@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4"])
def test_entries_that_are_not_finite_are_counted_per_layer(fmt):
    """NaN and inf keys or values (NaN activations) are counted as they are stored, per layer
    and per role; a cache without the counters keeps working as before."""
    nonfinite = [torch.zeros(2, dtype=torch.int64) for _ in range(LAYERS)]
    cache, _ = _cache(fmt, nonfinite=nonfinite)
    keys, values = _states(4, seed=5), _states(4, (4.0, 1.0), seed=6)
    keys[0, 1, 2, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    values[0, 0, 0, 0] = float("nan")
    out_k, _ = cache.update(keys, values, 1)
    assert nonfinite[1].tolist() == [3, 1] and nonfinite[0].tolist() == [0, 0]
    assert bool(torch.isnan(out_k[0, 1, 2, 0]))            # stored as NaN: read back as NaN
    cache.update(_states(2, seed=7), _states(2, (4.0, 1.0), seed=8), 1)
    assert nonfinite[1].tolist() == [3, 1]
    plain, _ = _cache(fmt)
    plain.update(keys, values, 1)                          # no counters: nothing counted
