"""The backend end to end: rewrites counted per kind, any batch size, no silent eager fallback."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.core import compat
import models_zoo
from tests.hf_models import build_hf


@pytest.fixture(autouse=True)
def _fresh_counters():
    counters.clear()


@pytest.mark.slow
def test_explicit_sites_take_any_batch_size_without_recompiling():
    """An explicit (in-place) site used to bake the batch size into its program: a recompile
    per batch size, then Dynamo's recompile limit and an eager run without FP8 at batch 9."""
    zoo = models_zoo.get("nanogpt-explicit")
    wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager")
    with torch.no_grad():
        for batch in range(1, 13):
            wrapped(**zoo.example_inputs(batch=batch, seq_len=16))
    records = list(wrapped.geoscale.records.values())
    assert records and all(r.plan.lowering == "inplace" for r in records)
    assert all(r.state.steps.item() == 12 for r in records)
    assert wrapped.geoscale.compiles <= 2          # static, then one dynamic-batch graph
    assert wrapped.eager_calls == 0


def test_explicit_site_with_merged_batch_and_heads_takes_any_batch_size():
    """Heads merged into the batch (bmm on (B·H, L, d_h)): the head of a score slice is its
    index modulo H, whatever B is."""
    class Merged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.qk = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)

        def forward(self, x):
            b, n, _ = x.shape
            q, k = self.qk(self.norm(x)).split(32, dim=-1)
            q = q.view(b, n, 4, 8).transpose(1, 2).reshape(b * 4, n, 8)   # (B·H, L, d_h)
            k = k.view(b, n, 4, 8).transpose(1, 2).reshape(b * 4, n, 8)
            probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / 8 ** 0.5, dim=-1)
            return torch.bmm(probs, k)

    model = Merged()
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager", audit=True)
    with torch.no_grad():
        for batch in (1, 2, 3, 5):
            x = torch.randn(batch, 6, 32) * torch.linspace(0.5, 4.0, 32)
            wrapped(x)
            q, k = model.qk(model.norm(x)).split(32, dim=-1)
            q, k = (t.view(batch, 6, 4, 8).transpose(1, 2) for t in (q, k))
            per_head = (q @ k.transpose(-1, -2) / 8 ** 0.5).abs().amax(dim=(0, 2, 3))
            record, = wrapped.geoscale.records.values()
            # the audit's per-head max|S| is the eager one: slice i belongs to head i mod H
            torch.testing.assert_close(record.state.amax, per_head, rtol=1e-5, atol=1e-6)
    assert record.site.score_heads == (0, 1, 2, 3) and record.site.score_lead == ()
    assert record.state.steps.item() == 4 and record.state.overflow_steps.item() == 0
    assert wrapped.eager_calls == 0


class _Flagged(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv = torch.nn.LayerNorm(16), torch.nn.Linear(16, 48)

    def forward(self, x, flag: str):
        q, k, v = self.qkv(self.norm(x)).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return out if flag == "a" else out * 2   # a guard on the string: a recompile


def test_a_full_compiled_region_is_renewed_never_run_eagerly(caplog, monkeypatch):
    """Guards that keep changing (a new string per call) fill the call's region: past
    geoscale's limit it is dropped and compiled afresh, so no call runs without FP8 and
    the region never holds more than the limit; the renewal is said once."""
    monkeypatch.setattr(geoscale_fx.compile.attach, "RECOMPILE_LIMIT", 3)
    wrapped = geoscale_fx.wrap(_Flagged(), compiler="aot_eager")
    region = wrapped._geoscale_call.region
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        for i in range(8):
            wrapped(x, f"flag{i}")
            assert region.entries() <= 3
    assert wrapped.eager_calls == 0 and region.renewals == 2
    call = wrapped._geoscale_call
    assert call.compiling_calls == 8 and call.compile_seconds > 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "_Flagged's compiled call reached 3 entries" in warnings[0]
    assert "8 compiling call(s)" in str(geoscale_fx.report(wrapped))


def test_eager_fallback_is_warned_about_and_reported(caplog):
    """When Dynamo runs the model without the compiled graphs (here: a stance forcing eager
    execution), the model runs without FP8: the wrapper says so, naming the model, and
    ``report`` counts the calls."""
    wrapped = geoscale_fx.wrap(_Flagged(), compiler="aot_eager")
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        wrapped(x, "a")
        assert wrapped.eager_calls == 0
        with torch.compiler.set_stance("force_eager"):
            wrapped(x, "a")
            wrapped(x, "b")
    assert wrapped.eager_calls == 2
    warnings = [r.getMessage() for r in caplog.records if "WITHOUT FP8" in r.getMessage()]
    assert len(warnings) == 1 and "_Flagged" in warnings[0]
    report = geoscale_fx.report(wrapped)
    assert report.eager_calls == 2 and "2 call(s) ran eagerly" in str(report)


@pytest.mark.zoo
def test_rewrites_are_counted_per_lowering_and_modifier():
    """``counters["geoscale"]`` as Inductor's pattern passes keep them, asserted exactly."""
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        torch.compile(build_hf("gpt2-eager"), backend=geoscale_fx.backend(
            compiler="aot_eager"))(input_ids=ids)
    assert counters["geoscale"]["rewrite_inplace"] == 2
    assert counters["geoscale"]["modifier_mask"] == 2      # the causal mask, left as it was
    assert counters["geoscale"]["rewrite_fused"] == 0
    counters.clear()
    with torch.no_grad():
        torch.compile(build_hf("llama-sdpa"), backend=geoscale_fx.backend(
            compiler="aot_eager", lowering="fused"))(input_ids=ids)
    assert counters["geoscale"]["rewrite_fused"] == 2
    assert counters["geoscale"]["left_as_is"] == 0
    assert counters["geoscale"]["sites_found"] == 2


def test_left_as_is_sites_are_counted_and_reported():
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, norm_first=True)
    compiled = torch.compile(layer, backend=geoscale_fx.backend(compiler="aot_eager"))
    compiled(torch.randn(2, 5, 16))
    assert counters["geoscale"]["left_as_is"] == 1
    assert counters["geoscale"]["rewrite_fused"] + counters["geoscale"]["rewrite_explicit"] == 0
    skipped = geoscale_fx.report(compiled).skipped
    assert len(skipped) == 1 and "opaque fused op" in skipped[0]["reason"]


@pytest.mark.slow   # end-to-end decoding
@pytest.mark.zoo
def test_generate_through_the_wrapper_runs_the_rewritten_model(caplog):
    """``wrap(model).generate`` calls the geoscale-compiled forward for the prefill and every
    decode step (one state per site, steps counted), with eager's tokens, nothing left as
    is, and no warning."""
    model = build_hf("llama-sdpa")
    ids = torch.randint(0, 128, (1, 4))
    expected = model.generate(ids, max_new_tokens=3, do_sample=False)
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager")
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        out = wrapped.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, expected)
    assert not [r for r in caplog.records if "WITHOUT FP8" in r.getMessage()]
    report = wrapped.report()
    assert not report.skipped and wrapped.eager_calls == 0
    n_layers = model.config.num_hidden_layers
    assert len(report.rows) == n_layers                 # one row (one state) per site
    assert all(row["steps"] == 3 for row in report.rows)   # prefill + 2 decode steps
    assert all(row["cached_steps"] == 2 for row in report.rows)   # the decode steps
    # the model's own methods still work, and its forward is not left patched
    assert model._compiled_call_impl is None


class _TinyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv = torch.nn.LayerNorm(16), torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def test_apply_gives_each_model_its_own_dynamo_cache():
    """Many converted instances of one class: each compiles its own code object into its
    own cache region, with geoscale's own recompile limit. Under a global limit of 1, a
    shared cache would make every instance after the first a recompile of the same code,
    run eagerly, without FP8."""
    models = [geoscale_fx.apply_(_TinyAttention(), compiler="aot_eager") for _ in range(3)]
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        for model in models:
            model(torch.randn(2, 5, 16))
    assert [[r["steps"] for r in geoscale_fx.report(m).rows] for m in models] == [[1]] * 3
    compiled = [m._compiled_call_impl.compiled for m in models]
    assert [compat.region_entries(c) for c in compiled] == [1, 1, 1]
    codes = {id(c._torchdynamo_orig_callable.__code__) for c in compiled}
    assert len(codes) == 3
