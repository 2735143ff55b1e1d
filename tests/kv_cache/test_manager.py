"""Unit tests for ``geoscale_fx.kv_cache.manager``: one FP8 cache per ``generate`` call.

No generation here (``tests/test_kv_cache.py`` generates end to end): the manager's caches are
checked against the bounds it traced (every stored scale covers its head's bound at R_max),
its ``generate`` keyword handling against the keywords it was given, and its saturation
counts against entries written here past the scale.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from geoscale_fx.kv_cache.layers import FP8Layer, NVFP4Layer
from geoscale_fx.kv_cache.manager import KVCacheManager, cache_argument
from tests.hf_models import build_hf


def _ids(batch: int = 1, length: int = 6) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(0))


def test_new_cache_holds_scales_covering_the_traced_bounds_and_rows_report_them():
    manager = KVCacheManager(build_hf("llama-sdpa"), "fp8")
    assert manager.rows() == {}
    cache = manager.new_cache(_ids())
    layers = manager.last_layers
    assert [type(layer).__name__ for layer in cache.layers] == ["FP8DynamicLayer"] * 2
    for layer, scales in zip(cache.layers, layers):
        assert isinstance(layer, FP8Layer) and layer.fmt == "e4m3"
        assert bool((layer.k_scale.double() * 448.0 >= scales.k_bound).all())
        assert bool((layer.v_scale.double() * 448.0 >= scales.v_bound).all())
    rows = manager.rows()
    assert list(rows) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for (site, row), layer in zip(rows.items(), cache.layers):
        assert row == {"k_scale": float(layer.k_scale.max()), "v_scale": float(layer.v_scale.max()),
                       "kv_saturated": 0}


def test_a_hybrids_cache_stores_fp8_only_in_its_attention_layer():
    """Qwen3-Next (linear attention, then full attention): cache layer 0 stays transformers'
    ``LinearAttentionLayer``, layer 1 takes the attention's scales (one kv head here)."""
    from geoscale_fx.testing.hf_configs import tiny_model

    torch.manual_seed(0)
    manager = KVCacheManager(tiny_model("qwen3_next").eval(), "fp8")
    cache = manager.new_cache(_ids())
    assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer",
                                                                "FP8DynamicLayer"]
    (scales,) = manager.last_layers
    assert (scales.layer, scales.site) == (1, "model.layers.1.self_attn")
    assert bool((cache.layers[1].k_scale.double() * 448.0 >= scales.k_bound).all())
    assert list(manager.rows()) == ["model.layers.1.self_attn"]


def test_rows_of_an_attention_writing_two_layers_take_the_max_and_the_sum():
    """A shared block called at two layers: one row, the larger scale, saturations summed."""
    from geoscale_fx.kv_cache.layer_scales import LayerScales

    manager = KVCacheManager(build_hf("llama-sdpa"), "fp8")
    b = lambda *v: torch.tensor(v, dtype=torch.float64)                    # noqa: E731
    manager.last_layers = [LayerScales(0, "shared", b(1.0), b(448.0, 1.0), b(1.0, 1.0)),
                           LayerScales(1, "shared", b(1.0), b(1.0, 1.0), b(896.0, 1.0))]
    manager.saturated = [torch.tensor([1, 0]), torch.tensor([0, 2])]
    manager.nonfinite = [torch.zeros(2, dtype=torch.int64), torch.tensor([0, 3])]
    assert manager.rows() == {"shared": {"k_scale": 1.0, "v_scale": 2.0, "kv_saturated": 3,
                                         "kv_nonfinite": 3}}


def test_saturation_is_counted_across_caches_and_warned_about(caplog):
    manager = KVCacheManager(build_hf("llama-sdpa"), "fp8_e5m2")
    first = manager.new_cache(_ids())
    scale = first.layers[1].k_scale
    keys = torch.zeros(1, 2, 3, 16)
    keys[0, 0, 0, :2] = 1e6 * scale[0]                        # far past 57344 · s
    first.update(keys, torch.zeros_like(keys), 1)
    second = manager.new_cache(_ids())
    assert second.layers[1].saturated is first.layers[1].saturated
    assert manager.saturated_total() == 2 and manager.rows()[
        "model.layers.1.self_attn"]["kv_saturated"] == 2
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        manager.after_generate()
    assert "2 cached entries reached ±R_max" in caplog.text


def test_entries_that_are_not_finite_are_counted_reported_and_warned_once(caplog):
    """A generation whose keys turn NaN (a token with a NaN embedding: not a weight the
    bounds read) stores NaN; the manager counts it per layer, ``rows`` reports it, and
    ``after_generate`` says it once per new count."""
    model = build_hf("llama-sdpa")
    manager = KVCacheManager(model, "fp8")
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = float("nan")
    ids = _ids()
    ids[0, 2] = 7
    kwargs = manager.generate_kwargs((ids,), {})
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_argument(): kwargs[cache_argument()]})
    rows = manager.rows()
    assert rows["model.layers.0.self_attn"]["kv_nonfinite"] == 2 * 16 * 2   # heads × d_h × k, v
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        manager.after_generate()
        manager.after_generate()
    said = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(said) == 1 and "kv_nonfinite" in said[0]


def test_generate_kwargs_build_a_dynamic_or_static_cache(caplog):
    manager = KVCacheManager(build_hf("llama-sdpa"), "nvfp4")
    ids = _ids(length=5)
    name = cache_argument()
    kwargs = manager.generate_kwargs((ids,), {"max_new_tokens": 3})
    assert isinstance(kwargs[name].layers[0], NVFP4Layer)
    static = manager.generate_kwargs((), {"input_ids": ids, "max_new_tokens": 3,
                                          "cache_implementation": "static"})
    assert "cache_implementation" not in static
    assert static[name].layers[0].max_cache_len == 5 + 3
    for given in ("cache", "past_key_values"):      # the caller's own, under either name
        own = object()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
            out = manager.generate_kwargs((ids,), {given: own})
        assert out == {given: own}
        assert f"got its own {given}; it is used as is (not FP8)" in caplog.text


def test_the_cache_goes_under_the_name_generate_takes():
    """transformers 5.24 renamed generate's ``past_key_values`` to ``cache`` (the old name
    deprecated): the name is read from the installed version's list of cache names."""
    import transformers
    from transformers.generation import utils

    expected = "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else \
        "past_key_values"
    assert cache_argument() == expected
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) >= (5, 24):
        assert cache_argument() == "cache"


def test_refusals_name_the_option():
    with pytest.raises(ValueError, match="kv_cache='fp8'.*Linear keeps its own cache"):
        KVCacheManager(nn.Linear(2, 2), "fp8")
    with pytest.raises(ValueError, match="kv_cache='int8'; allowed values"):
        KVCacheManager(nn.Linear(2, 2), "int8")
    manager = KVCacheManager(build_hf("llama-sdpa"), "fp8")
    with pytest.raises(ValueError, match="not cache_implementation='offloaded'"):
        manager.generate_kwargs((_ids(),), {"cache_implementation": "offloaded"})
    with pytest.raises(ValueError, match="generate needs input_ids"):
        manager.generate_kwargs((), {})
