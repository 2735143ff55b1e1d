"""The encoders sentence-transformers loads most, besides BERT: MPNet (all-mpnet-base-v2) and
DeBERTa-v2/v3. Their logits carry learned position terms added before the softmax (MPNet's
bucketed relative bias with ``+=``; DeBERTa's content-to-position and position-to-content
terms, under a scale that is a tensor, ``sqrt(tensor(d_h) · 3)``): the content logits
``q·kᵀ`` are bounded and go through FP8, the position terms are added after them in high
precision and named in the report. Checked against independent references: the logits
recomputed from the graph's own operands under inputs optimized against the bound,
``scaling="none"`` against eager, and an audited run with gains ×4.
"""
from __future__ import annotations

import pytest
import torch

import geoscale_fx
from tests.analysis_checks import (adversarial, assert_none_scaling_equals_eager,
                                   scale_up_gains_and_biases)

transformers = pytest.importorskip("transformers")

D, H = 64, 4


def _mpnet():
    config = transformers.MPNetConfig(num_hidden_layers=2, hidden_size=D, num_attention_heads=H,
                                      intermediate_size=128, vocab_size=100)
    return transformers.MPNetModel(config).eval(), "encoder.layer.{}.attention.attn"


def _deberta_v3():
    """DeBERTa-v3's layout: shared attention keys, 256 position buckets, a LayerNorm on the
    relative embeddings, both disentangled terms."""
    config = transformers.DebertaV2Config(
        num_hidden_layers=2, hidden_size=D, num_attention_heads=H, intermediate_size=128,
        vocab_size=100, relative_attention=True, position_buckets=256,
        max_relative_positions=-1, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
        share_att_key=True)
    return transformers.DebertaV2Model(config).eval(), "encoder.layer.{}.attention.self"


def _deberta_v2():
    """DeBERTa-v2's: separate position projections (``pos_key_proj``/``pos_query_proj``)."""
    config = transformers.DebertaV2Config(
        num_hidden_layers=2, hidden_size=D, num_attention_heads=H, intermediate_size=128,
        vocab_size=100, relative_attention=True, max_relative_positions=32,
        pos_att_type=["p2c", "c2p"], share_att_key=False)
    return transformers.DebertaV2Model(config).eval(), "encoder.layer.{}.attention.self"


FAMILIES = {"mpnet": (_mpnet, 0.25), "deberta-v3": (_deberta_v3, (D // H * 3) ** -0.5),
            "deberta-v2": (_deberta_v2, (D // H * 3) ** -0.5)}


@pytest.mark.parametrize("family", FAMILIES)
def test_sites_are_bounded_with_their_position_terms_named(family):
    build, scale = FAMILIES[family]
    torch.manual_seed(0)
    model, name = build()
    sites = geoscale_fx.find_attention(model, torch.randint(0, 100, (2, 10)))
    assert [s.name for s in sites] == [name.format(i) for i in range(2)]
    assert all(s.supported and s.bound_by == "weights" for s in sites)
    assert all(s.softmax_scale == pytest.approx(scale, rel=1e-6) for s in sites)
    assert all("position_bias" in [m.kind for m in s.modifiers] for s in sites)


@pytest.mark.parametrize("family", ["mpnet", "deberta-v3"])
def test_bound_holds_under_inputs_optimized_against_it(family):
    torch.manual_seed(0)
    model, _ = FAMILIES[family][0]()
    scale_up_gains_and_biases(model, 4.0)
    sites, best, _ = adversarial(model, steps=12, batch=2, seq=10, d=D)
    assert len(sites) == 2 and all(s.supported for s in sites)
    assert bool((best <= 1.0).all()) and bool((best > 0).all()), best


@pytest.mark.parametrize("family", ["mpnet", "deberta-v3"])
def test_none_scaling_equals_eager_and_an_audit_never_overflows(family):
    torch.manual_seed(0)
    model, name = FAMILIES[family][0]()
    ids = torch.randint(0, 100, (2, 10))
    # the rewritten graphs run eagerly: the rewrite per family, without the AOT trace or
    # Inductor (the compiled paths have their own tests)
    assert_none_scaling_equals_eager(model, ids, compiler="eager")
    scale_up_gains_and_biases(model, 4.0)
    torch._dynamo.reset()
    wrapped = geoscale_fx.wrap(model, compiler="eager", audit=True)
    with torch.no_grad():
        wrapped(ids)
    report = geoscale_fx.report(wrapped, per_head=True)
    assert len(report.rows) == 2 * H
    for row in report.rows:
        assert row["max_scaled"] * row["scale"] <= row["bound"] and row["overflow_steps"] == 0
        assert "added after the FP8 logits, in high precision" in row["note"]
