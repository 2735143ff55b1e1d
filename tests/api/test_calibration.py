import copy

import numpy as np
import pytest
import torch

import geoscale_fx
from geoscale_fx.core import bounds

models_zoo = pytest.importorskip("models_zoo")

B, L = 2, 32
#: the rewritten graphs run eagerly: the calibration's state, not the AOT trace (the fused
#: lowering's test keeps aot_eager)
COMPILER = "eager"


_TRAINED: dict = {}


def _trained_nanogpt(steps=100, seed=1):
    """A nanoGPT whose attention has learned something (a copy task), in eval mode: a copy of
    the one trained once per ``(steps, seed)`` for the module."""
    if (steps, seed) not in _TRAINED:
        _TRAINED[steps, seed] = _train_nanogpt(steps, seed)
    return copy.deepcopy(_TRAINED[steps, seed])


def _train_nanogpt(steps: int, seed: int):
    zoo = models_zoo.get("nanogpt", seed=seed)
    model = zoo.model.train()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x = torch.randint(0, 16, (8, L), generator=gen)
        opt.zero_grad()
        model(x, x)[1].backward()
        opt.step()
    return zoo, model.eval()


def _batches(n, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [{"idx": torch.randint(0, 16, (B, L), generator=gen)} for _ in range(n)]


def test_alpha_final_is_the_quantile_of_recorded_ratios_times_kappa():
    zoo, model = _trained_nanogpt()
    steps, q, kappa = 6, 0.9, 1.25
    wrapped = geoscale_fx.wrap(model, compiler=COMPILER, alpha="auto", calib_steps=steps,
                               quantile=q, kappa=kappa)
    observed = []                               # independent record: max|S| / B_max per step
    with torch.no_grad():
        for batch in _batches(steps):
            wrapped(**batch)
            observed.append([(r.state.amax / r.state.bound).tolist()
                             for r in wrapped.geoscale.records.values()])
    observed = np.array(observed)               # (steps, sites, heads)
    for i, record in enumerate(wrapped.geoscale.records.values()):
        expected = np.quantile(observed[:, i, :], q, axis=0) * kappa
        np.testing.assert_allclose(record.state.alpha_final.numpy(), expected, rtol=1e-5)
        assert record.state.calibrated.item() == 1
        assert record.state.calib_count.item() == steps
    row = geoscale_fx.report(wrapped).rows[0]
    assert row["ratios"] == steps and row["alpha_emp"] == pytest.approx(
        float(np.quantile(observed[:, 0, :], q, axis=0).max()), rel=1e-5)


def test_zero_overflows_on_the_calibration_distribution_and_better_utilization(capsys):
    zoo, model = _trained_nanogpt()
    batches = _batches(8)
    # one model per wrapper: a wrapper keeps its state on its model
    theory = geoscale_fx.wrap(copy.deepcopy(model), compiler=COMPILER, alpha="theory",
                              audit=True)
    auto = geoscale_fx.calibrate(copy.deepcopy(model), batches, compiler=COMPILER,
                                 progress=False)
    # replay the calibration batches with audits: theory α vs the frozen auto α
    checker = geoscale_fx.wrap(copy.deepcopy(model), compiler=COMPILER, alpha="auto",
                               audit=True, calib_steps=len(batches))
    checker.load_state_dict(auto.state_dict())
    util = {"theory": [], "auto": []}
    with torch.no_grad():
        for batch in batches:
            for name, wrapped in (("theory", theory), ("auto", checker)):
                wrapped(**batch)
                util[name] += [r.state.max_scaled.max().item() / 448
                               for r in wrapped.geoscale.records.values()]
    for name, wrapped in (("theory", theory), ("auto", checker)):
        assert all(r.state.overflow_steps.item() == 0 for r in wrapped.geoscale.records.values())
    med = {k: float(np.median(v)) for k, v in util.items()}
    with capsys.disabled():
        print(f"\nnanoGPT (trained on a copy task), FP8 utilization median: theory alpha "
              f"{100 * med['theory']:.2f}%, auto alpha {100 * med['auto']:.2f}%")
    assert med["auto"] > med["theory"]
    # α_final ≈ the largest slack ratio, so the calibration batches reach about η = 0.8
    # (upstream FP8 rounding differs slightly between burn-in α0 and the frozen α)
    assert 0.5 < max(util["auto"]) <= 0.8 * 1.02


def test_after_calibration_the_fused_lowering_runs():
    """After the burn-in (explicit: it records the scores), the frozen-α graph is the fused
    one (flex_attention, never the L×L scores; ``tests/test_backend.py``'s Inductor test
    reads the generated code of that lowering)."""
    zoo = models_zoo.get("nanogpt")
    seq = 48
    gen = torch.Generator().manual_seed(0)
    batches = [zoo.example_inputs(batch=B, seq_len=seq, generator=gen) for _ in range(3)]
    wrapped = geoscale_fx.calibrate(zoo.model, batches[:2], progress=False,
                                    compiler="aot_eager", lowering="fused")
    runtime, = wrapped.geoscale.runtimes
    with torch.no_grad():
        wrapped(**batches[2])
    assert runtime.variants[runtime.main]._value is not None       # the main variant ran
    assert {r.plan.lowering for r in wrapped.geoscale.records.values()} == {"fused"}
    assert all(bool(r.state.calibrated) for r in wrapped.geoscale.records.values())


def test_state_dict_round_trips_before_during_and_after_calibration():
    zoo, model = _trained_nanogpt(steps=40)
    batches = _batches(6)

    def fresh():
        twin = models_zoo.get("nanogpt", seed=9).model
        twin.load_state_dict({k: v for k, v in model.state_dict().items()
                              if not k.startswith("geoscale_state")})
        return geoscale_fx.wrap(twin.eval(), compiler=COMPILER, alpha="auto", calib_steps=4)

    reference = fresh()
    with torch.no_grad():
        for batch in batches[:4]:
            reference(**batch)
    expected = [r.state.alpha_final.clone() for r in reference.geoscale.records.values()]

    before = fresh()                                   # before: nothing recorded yet
    empty = {k: v for k, v in before.state_dict().items()}
    resumed_before = fresh()
    resumed_before.load_state_dict(empty)
    with torch.no_grad():
        for batch in batches[:4]:
            resumed_before(**batch)
    during = fresh()                                   # during: 2 of 4 ratios recorded
    with torch.no_grad():
        for batch in batches[:2]:
            during(**batch)
    resumed = fresh()
    resumed.load_state_dict(during.state_dict())
    with torch.no_grad():
        for batch in batches[2:4]:
            resumed(**batch)
    after = fresh()                                    # after: already calibrated
    after.load_state_dict(reference.state_dict())
    with torch.no_grad():
        after(**batches[4])
    for wrapped in (resumed_before, resumed, after):
        got = [r.state.alpha_final for r in wrapped.geoscale.records.values()]
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert all(r.state.calib_count.item() == 4 for r in after.geoscale.records.values())
    # after calibration the burn-in variant is never compiled: one compile, predictive
    assert after.geoscale.compiles == 1


def test_non_finite_logit_during_burn_in_is_an_error_naming_the_site():
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import build_hf

    model = build_hf("gpt2-sdpa")
    wrapped = geoscale_fx.wrap(model, compiler=COMPILER, alpha="auto", calib_steps=3)
    embeds = torch.randn(B, 8, 64)
    embeds[0, 3, 5] = float("nan")
    with pytest.raises(RuntimeError, match=r"non-finite logits.*transformer\.h\.0\.attn"):
        with torch.no_grad():
            wrapped(inputs_embeds=embeds)
    del transformers


@pytest.mark.parametrize("kwargs, match", [({"kappa": 0.9}, "kappa"), ({"quantile": 1.5},
                                           "quantile"), ({"calib_steps": 0}, "calib_steps")])
def test_guard_rails(kwargs, match):
    with pytest.raises(ValueError, match=match):
        geoscale_fx.wrap(torch.nn.Linear(2, 2), alpha="auto", **kwargs)


def test_theory_alpha_is_alpha_min_per_site_and_follows_the_sequence_length():
    zoo = models_zoo.get("nanogpt")
    wrapped = geoscale_fx.wrap(zoo.model, compiler=COMPILER, alpha="theory")
    n_total = zoo.n_layers * zoo.n_q_heads
    for seq in (16, 64):
        with torch.no_grad():
            wrapped(**zoo.example_inputs(batch=B, seq_len=seq))
        expected = bounds.alpha_min(zoo.model_dim, zoo.head_dim, n_total, seq, 1e-6)
        for row in geoscale_fx.report(wrapped).rows:
            assert row["alpha"] == pytest.approx(expected, rel=1e-6)


def test_calibrate_with_a_progress_bar_gives_the_same_frozen_state(capsys):
    zoo, model = _trained_nanogpt(steps=40)
    batches = _batches(5)
    by_hand = geoscale_fx.wrap(model, compiler=COMPILER, alpha="auto",
                               calib_steps=len(batches))
    with torch.no_grad():
        for batch in batches:
            by_hand(**batch)
    expected = {k: v.clone() for k, v in model.state_dict().items() if "alpha_final" in k}
    for key in list(model.geoscale_state.sites.keys()):
        del model.geoscale_state.sites[key]
    calibrated = geoscale_fx.calibrate(model, batches, compiler=COMPILER)
    err = capsys.readouterr().err
    assert "geoscale auto-alpha" in err and "5/5" in err
    got = {k: v for k, v in calibrated.state_dict().items() if "alpha_final" in k}
    assert got.keys() == expected.keys()
    for k in got:
        torch.testing.assert_close(got[k], expected[k])


def test_calibrate_with_fewer_batches_than_calib_steps_freezes_what_it_saw(caplog):
    zoo, model = _trained_nanogpt(steps=20)
    wrapped = geoscale_fx.calibrate(model, iter(_batches(3)), compiler=COMPILER,
                                    calib_steps=10, progress=False)
    records = list(wrapped.geoscale.records.values())
    assert all(r.state.calibrated.item() == 1 and r.state.calib_count.item() == 3
               for r in records)
    assert "3 calibration batches for calib_steps=10" in caplog.text
