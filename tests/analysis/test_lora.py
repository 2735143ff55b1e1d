"""PEFT LoRA adapters on the query/key projections: one source and two maps (``W x̂ +
s·B A x̂``, bounded on the effective weight ``W + s·B A``), or, under adapter dropout in
training, one term per pair of maps. Checked against the merged model, observed logits and a
geoscale training run whose bound follows the adapter."""
from __future__ import annotations

import copy

import pytest
import torch

import geoscale_fx
from geoscale_fx.numerics.head_weights import site_head_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests import analysis_checks as checks
from tests.hf_models import build_hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.zoo


def _lora(model, dropout=0.0, targets=("q_proj", "k_proj", "v_proj"), **kwargs):
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                             target_modules=list(targets), **kwargs)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():   # B starts at zero: give the adapter something to add
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return model


def _sites(model, ids):
    return geoscale_fx.find_attention(model, input_ids=ids)


@pytest.mark.parametrize("family, targets, extra", [
    ("llama-sdpa", ("q_proj", "k_proj", "v_proj"), {}),
    ("gpt2-sdpa", ("c_attn",), {"fan_in_fan_out": True}),   # fused qkv, Conv1D
])
def test_adapter_is_folded_into_the_effective_weight(family, targets, extra):
    model = _lora(build_hf(family), targets=targets, **extra).eval()
    ids = torch.randint(0, 128, (2, 6))
    sites = _sites(model, ids)
    merged = copy.deepcopy(model).merge_and_unload()
    reference = _sites(merged, ids)
    assert len(sites) == len(reference) == 2
    for site, ref in zip(sites, reference):
        assert site.supported and site.certified, site.reason
        assert len(site.terms) == 1 and site.q.low_rank and site.k.low_rank
        assert not ref.q.low_rank
        for ours, theirs in zip(site_head_weights(site), site_head_weights(ref)):
            if theirs is None:
                assert ours is None
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(site_logit_bound(site), site_logit_bound(ref), rtol=1e-6, atol=0)
        assert any("lora_B" in p for p in site.param_names)


def test_adapter_dropout_in_training_makes_a_term_per_pair_and_the_bound_holds():
    """``B A dropout(x̂)`` reads another input than ``W x̂``: q and k are each two maps of
    two sources, four terms; the bound holds on logits observed under random dropout masks."""
    from geoscale_fx.analysis.capture import capture_graphs
    from geoscale_fx.analysis.analyze import analyze_graph

    model = _lora(build_hf("llama-sdpa"), dropout=0.3).train()
    ids = torch.randint(0, 128, (2, 6))
    (graph, *_) = capture_graphs(model, input_ids=ids)
    (site, *_) = analyze_graph(graph.gm, graph.example_inputs)
    assert site.supported and site.certified, site.reason
    assert len(site.terms) == 4
    radii = sorted({t.q.radius for t in site.terms})
    assert radii[1] == pytest.approx(radii[0] / 0.7)      # dropout widens the adapter's input
    bound = site_logit_bound(site)
    worst = 0.0
    for _ in range(8):
        values = checks.record(graph.gm, graph.example_inputs)
        observed = checks.observed_logits(graph.gm, values, site, batch=2)
        assert (observed <= bound * (1 + 1e-6)).all()
        worst = max(worst, float((observed / bound).max()))
    assert worst > 0.01


@pytest.mark.slow   # end-to-end training
def test_training_the_adapter_moves_the_bound_and_never_overflows():
    model = _lora(build_hf("llama-sdpa")).train()
    geoscale_fx.apply_(model, compiler="aot_eager", audit=True, estimator="exact")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 128, (2, 8))
    bounds = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        states = list(model.geoscale_state.sites.values())
        bounds.append(torch.stack([s.bound.clone() for s in states]))
        assert all(s.overflow_steps.item() == 0 for s in states)
    report = geoscale_fx.report(model)
    assert not report.skipped and all(row["certified"] for row in report.rows)
    assert not torch.equal(bounds[0], bounds[-1])        # the adapter trained, the bound moved


def test_an_adapter_on_v_proj_is_folded_into_the_values_bound():
    """PEFT's default targets include v_proj: the values' amax bound (what an FP8 KV cache
    and fp8_qkv read) folds the adapter as q and k do (found by the fuzz generator: it used
    to report "the value comes from several projections" and bound nothing)."""
    from geoscale_fx.numerics.amax import site_amax_bounds

    model = _lora(build_hf("llama-sdpa"), targets=("v_proj",)).eval()
    ids = torch.randint(0, 128, (2, 8))
    sites = _sites(model, ids)
    assert sites and all(s.value is not None for s in sites), [s.value_reason for s in sites]
    assert all(s.value.low_rank for s in sites)           # W + s·B·A, not W alone
    merged = copy.deepcopy(model).merge_and_unload()
    for site, merged_site in zip(sites, _sites(merged, ids)):
        torch.testing.assert_close(site_amax_bounds(site)["v"],
                                   site_amax_bounds(merged_site)["v"], rtol=1e-6, atol=1e-9)
