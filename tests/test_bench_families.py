"""bench/families.py: its spies against explicit computations, and rows of real families."""
import math

import pytest
import torch
import torch.nn.functional as F

from bench.families import Spy, backend_sites, family_row, summary

pytest.importorskip("transformers")


def test_sdpa_spy_recomputes_gqa_logits_per_query_head():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)                  # (B, n_q, T, d_h)
    k = torch.randn(2, 2, 5, 8, generator=g)                  # (B, n_kv, S, d_h)
    v = torch.randn(2, 2, 5, 8, generator=g)
    original, spy = F.scaled_dot_product_attention, Spy()
    with spy.watching():
        assert F.scaled_dot_product_attention is not original
        out = F.scaled_dot_product_attention(q, k, value=v, enable_gqa=True)
    assert F.scaled_dot_product_attention is original          # restored on exit
    torch.testing.assert_close(out, original(q, k, v, enable_gqa=True))
    [call] = spy.calls
    expected = [max(abs(sum(q[b, h, t, i].item() * k[b, h // 2, s, i].item() for i in range(8)))
                    for b in range(2) for t in range(5) for s in range(5)) / math.sqrt(8)
                for h in range(4)]
    assert call.kind == "sdpa"
    torch.testing.assert_close(call.amax, torch.tensor(expected, dtype=torch.float64))


def test_softmax_spy_counts_key_axis_softmaxes_once():
    x = torch.randn(2, 3, 4, 4)
    originals = (torch.softmax, F.softmax, torch.Tensor.softmax)
    spy = Spy()
    with spy.watching():
        F.softmax(x, dim=-1)             # calls Tensor.softmax inside: one call, not two
        torch.softmax(x, 3)
        x.softmax(-1)
        x.softmax(1)                     # not over the key axis
        torch.softmax(x[0, 0], -1)       # 2-D: a router, not attention
    assert [c.kind for c in spy.calls] == ["softmax"] * 3
    assert (torch.softmax, F.softmax, torch.Tensor.softmax) == originals


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_supported_families_are_covered_and_certified(model_type):
    row = family_row(model_type, timeout=120)
    assert row["error"] == "" and row["built"]
    assert row["calls"] == row["sites"] == row["supported"] == 2     # 2 layers
    assert row["silent"] == 0 and row["reasons"] == {}
    spy_checks, audit_checks = map(int, row["checks spy/audit"].split("/"))
    assert spy_checks == 2 * 2 * 4         # inputs × sites × heads
    assert audit_checks == 2 * 4             # sites × heads (both inputs in one batch)
    assert 0 < row["max obs/bound"] <= 1 and row["violations"] == 0
    assert row["none==eager"] is True and row["overflows"] == 0


def test_summary_counts_supported_calls_and_silent_misses():
    rows = [{"built": True, "calls": 4, "sites": 3, "supported": 2, "silent": 1,
             "violations": 0, "none==eager": True, "overflows": 0, "error": ""},
            {"built": False, "calls": None, "sites": None, "supported": None, "silent": None,
             "violations": None, "none==eager": None, "overflows": None, "error": "not built"}]
    s = summary(rows)
    assert (s["built"], s["calls"], s["supported"], s["silent misses"]) == (1, 4, 2, 1)
    assert s["supported %"] == 50.0


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "cpmant"])
def test_backend_sites_are_the_sites_find_attention_finds(model_type):
    import geoscale_fx
    from geoscale_fx import hf_configs

    model = hf_configs.tiny_model(model_type)
    inputs = hf_configs.token_inputs(model, seq_len=32)
    wrapped = geoscale_fx.wrap(model, scaling="none", compiler="aot_eager")
    with torch.no_grad():
        wrapped(**inputs)
    expected = [(s.name, s.node, s.supported, s.reason)
                for s in geoscale_fx.find_attention(model, **inputs)]
    assert [(s.name, s.node, s.supported, s.reason) for s in backend_sites(wrapped)] == expected
    assert len(expected) == 2


def test_a_refused_family_is_listed_with_its_reason_not_as_a_silent_miss():
    row = family_row("cpmant", timeout=120)          # CPM-Ant: P is masked after the softmax
    assert row["error"] == "" and row["built"]
    assert (row["calls"], row["sites"], row["supported"], row["silent"]) == (2, 2, 0, 0)
    [(reason, count)] = row["reasons"].items()
    assert count == 2 and "never multiply values" in reason
    assert row["checks spy/audit"] == "0/0" and row["violations"] == 0
    assert row["none==eager"] is True and row["overflows"] == 0


def test_an_unbuildable_family_is_a_row_with_the_reason():
    row = family_row("dbrx", timeout=60)
    assert row["built"] is False and row["error"].startswith("not built: model type 'dbrx'")
    assert row["calls"] is None
