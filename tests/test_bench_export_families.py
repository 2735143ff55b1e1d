"""bench/export_families.py: its cache comparison on explicit numbers, its outcome classes,
and one real family end to end."""
from __future__ import annotations

import pytest
import torch

from bench.export_families import (_export_notes, _outcome, cached_amax, checkpoint_row,
                                   compare_with_cache, family_row, summary)

pytest.importorskip("transformers")


def _scale(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1)      # (n_kv, 1, 1)


def test_per_head_comparison_counts_each_entry_over_its_heads_scale():
    scales = {"a.k_scale": _scale(1.0, 2.0), "a.v_scale": _scale(1.0, 1.0)}
    layers = {0: {"sites": {"a"}, "k": torch.tensor([448.0, 448.0], dtype=torch.float64),
                  "v": torch.tensor([224.0, 449.0], dtype=torch.float64)}}
    ratios, violations, notes = compare_with_cache(scales, layers)
    assert ratios == [1.0, 0.5, 0.5, 449 / 448] and violations == 1
    assert notes == ["layer 0 v: 449 > scale·448 = 448"]


def test_a_latent_cache_is_compared_whole_and_an_unwritten_layer_is_a_violation():
    """An MLA cache holds one latent "head" against per-head scales: its maximum is
    compared with the largest scale; a layer written outside every exported attention
    is bounded by none."""
    scales = {"a.k_scale": _scale(1.0, 2.0), "a.v_scale": _scale(1.0, 1.0)}
    layers = {0: {"sites": {"a"}, "k": torch.tensor([1000.0], dtype=torch.float64),
                  "v": None},
              1: {"sites": set(), "k": torch.tensor([1.0], dtype=torch.float64), "v": None}}
    ratios, violations, notes = compare_with_cache(scales, layers)
    assert ratios == [1000 / 896] and violations == 2
    assert notes[0].startswith("layer 0 k: cache has 1 heads, scales 2")
    assert notes[-1] == "cache layer 1 written outside any exported attention"


def test_the_exports_report_goes_into_the_notes():
    """Cache layers without a scale, by index and cache layer class; latent caches counted;
    attentions reusing a layer's cache, with that layer."""
    from types import SimpleNamespace

    from geoscale_fx.kv_cache.refusals import LayerRefusal

    export = SimpleNamespace(not_cached={2: "LinearAttentionLayer: written by no attention",
                                         0: "DummyLayer: written by no attention"},
                             latent=("m.1.attn",), shared={"m.layers.3.attn": 1},
                             left_at_default={4: LayerRefusal(4, "m.4.attn", "why")})
    assert _export_notes(export) == [
        "left at 1.0 (refused): 4 (`m.4.attn`: why)",
        "no scale for cache layers 0 (DummyLayer), 2 (LinearAttentionLayer)",
        "latent cache (one k/v scale, no q_scale): 1 attention(s)",
        "k/v scales of the cache layer they reuse: m.layers.3.attn → 1"]
    assert _export_notes(SimpleNamespace(not_cached={}, latent=(), shared={},
                                         left_at_default={})) == []


def test_outcomes_refused_only_for_geoscales_own_value_errors():
    from geoscale_fx.export.safetensors_reader import CheckpointReader

    try:
        CheckpointReader("/nonexistent-directory")
    except ValueError as exc:
        assert _outcome(exc)[0] == "refused"
    try:
        int("x")
    except ValueError as exc:                       # raised outside geoscale_fx
        assert _outcome(exc) == ("crashed", "ValueError: invalid literal for int() with "
                                            "base 10: 'x'")


def test_cached_amax_attributes_each_write_to_the_module_holding_the_site():
    """Llama's cache writes come from ``self_attn``: layer i to ``model.layers.i.self_attn``,
    its keys (B, n_kv, T, d_h) reduced per kv head."""
    from geoscale_fx.testing.hf_configs import tiny_model

    model = tiny_model("llama")
    sites = [f"model.layers.{i}.self_attn" for i in range(2)]
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    layers, notes = cached_amax(model, sites, [ids])
    assert not notes and sorted(layers) == [0, 1]
    n_kv = model.config.num_key_value_heads
    for i in range(2):
        assert layers[i]["sites"] == {sites[i]} and layers[i]["k"].shape == (n_kv,)


@pytest.mark.slow   # an export scenario end to end
def test_family_row_exports_llama_within_its_scales():
    row = family_row("llama")
    assert row["streamed"] == row["in-memory"] == "exported" and row["same scales"]
    assert row["violations"] == 0 and 0 < row["range worst"] <= 1 and row["checks"] > 0


@pytest.mark.slow   # an export scenario end to end
def test_a_partial_export_is_its_own_outcome_checked_on_the_layers_it_wrote(tmp_path):
    """OLMo-hybrid with layers full/linear/full: cache layer 2's attention reads an input
    the weights do not bound (tests/test_partial_export.py), so the export is ``partial``:
    one layer left at 1.0, layer 0 compared with what the model caches (its kv heads, k and
    v), layer 2 — written by the refused attention — not compared, and no violation."""
    from bench.export_families import _empty_row
    from geoscale_fx.testing import hf_configs

    config = hf_configs.tiny_config("olmo_hybrid", per_kind=1)
    config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    config.num_hidden_layers = 3
    hf_configs.model_from_config(config).save_pretrained(tmp_path / "ckpt")
    row = _empty_row("olmo_hybrid")
    checkpoint_row(row, tmp_path / "ckpt", tmp_path)
    assert row["streamed"] == row["in-memory"] == "partial" and row["same scales"]
    assert row["reason"].startswith("1 left at 1.0, first 2 (`model.layers.2.self_attn`): "
                                    "the stored values")
    assert row["left at 1.0"] == 1 and row["layers"] == 1
    assert row["checks"] == 2 * config.num_key_value_heads and row["violations"] == 0
    assert "left at 1.0 (refused): 2 (`model.layers.2.self_attn`" in row["notes"]
    counts = summary([row, {**row, "streamed": "exported", "left at 1.0": 0}])
    assert (counts["partial"], counts["exported"], counts["left at 1.0"]) == (1, 1, 1)
