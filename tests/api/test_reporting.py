"""``report()``: which sites belong to a model, what is certified, what was left as is."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import geoscale_fx
import models_zoo
from geoscale_fx.numerics.logit_bounds import site_logit_bound


class ExpressionWeights(torch.nn.Module):
    """q = x̂ @ W.t(): the weight reaches the site as an expression, not a placeholder."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.wq = torch.nn.Parameter(torch.randn(32, 32) / 6)
        self.wk = torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        h = self.norm(x)
        q = (h @ self.wq.t()).view(*x.shape[:2], 4, 8).transpose(1, 2)
        k = (h @ self.wk.t()).view(*x.shape[:2], 4, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, k)


def test_sites_whose_weight_is_an_expression_are_reported():
    """Ownership was keyed by id() of a weight placeholder: 1 record, 0 report rows."""
    model = ExpressionWeights()
    be = geoscale_fx.backend(compiler="aot_eager")
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        compiled(torch.randn(2, 8, 32))
    assert len(be.records) == 1
    assert len(geoscale_fx.report(compiled).rows) == 1
    assert len(geoscale_fx.report(model).rows) == 1           # the plain module too
    assert len(geoscale_fx.report(ExpressionWeights()).rows) == 0   # not another instance


def test_per_layer_bounds_are_never_reported_certified():
    """The paper's per-layer norm is not a bound on any head (heads cancel)."""
    zoo = models_zoo.get("nanogpt")
    wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager", granularity="layer",
                               estimator="exact", alpha=1.0)
    with torch.no_grad():
        wrapped(**zoo.example_inputs(batch=2, seq_len=16))
    rows = geoscale_fx.report(wrapped).rows
    assert rows and not any(r["certified"] for r in rows)


def test_per_head_exact_bounds_are_reported_certified_and_power_only_at_cold_start():
    zoo = models_zoo.get("nanogpt")
    exact = geoscale_fx.wrap(zoo.model, compiler="aot_eager")          # the default
    power = geoscale_fx.wrap(models_zoo.get("nanogpt").model, compiler="aot_eager",
                             estimator="power")
    with torch.no_grad():
        for _ in range(2):
            exact(**zoo.example_inputs(batch=2, seq_len=16))
        power(**zoo.example_inputs(batch=2, seq_len=16))
    assert all(r["certified"] for r in geoscale_fx.report(exact).rows)
    assert all(r["certified"] for r in geoscale_fx.report(power).rows)     # cold start
    with torch.no_grad():
        power(**zoo.example_inputs(batch=2, seq_len=16))
    assert not any(r["certified"] for r in geoscale_fx.report(power).rows)  # warm power step


def _with_event(model, event: str, other: dict) -> None:
    """``"jump"``: every weight ×3; ``"load"``: another model's plain weights (no geoscale
    state: the sites go cold); ``"step"``: nothing before the step."""
    with torch.no_grad():
        if event == "jump":
            for p in model.parameters():
                p.mul_(3.0)
        if event == "load":
            model.load_state_dict(other)


def _certified_per_step(estimator: str | None, events=("step", "step", "step"),
                        cover_exact: bool = False) -> list[bool]:
    """Train the zoo's nanoGPT one AdamW step (lr 3e-3: the weights move every step) after
    each event (``_with_event``); after each step, whether ``report()`` says every site is
    certified. ``cover_exact``: also check that every site's bound (float32, in the state)
    is ≥ the exact bound of the weights the step read (``site_logit_bound``: float64
    eigensolvers on the live parameters) and ≤ it × d_h^(1/256)."""
    zoo = models_zoo.get("nanogpt", seed=1)
    model = zoo.model.train()
    options = {} if estimator is None else {"estimator": estimator}
    wrapped = geoscale_fx.wrap(model, compiler="eager", **options)   # the rewrite, no AOT trace
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    sites = ({s.name: s for s in geoscale_fx.find_attention(model, torch.zeros(1, 16).long())}
             if cover_exact else {})
    other = models_zoo.get("nanogpt", seed=2).model.state_dict() if "load" in events else {}
    certified = []
    for event in events:
        _with_event(model, event, other)
        exact = {name: site_logit_bound(site) for name, site in sites.items()}
        x = torch.randint(0, 16, (4, 16), generator=gen)
        opt.zero_grad()
        _, loss = wrapped(x, (x + 1) % 16)
        loss.backward()
        opt.step()
        rows = geoscale_fx.report(wrapped).rows
        assert rows
        certified.append(all(r["certified"] for r in rows))
        records = {r.plan.site.name: r for r in wrapped.geoscale.records.values()}
        assert not cover_exact or sorted(records) == sorted(exact)
        for name in exact:
            bound, head_dim = records[name].state.bound.double(), records[name].plan.site.head_dim
            assert bool((bound >= exact[name]).all()), (event, name, bound / exact[name])
            assert bool((bound <= exact[name] * head_dim ** (1 / 256) * (1 + 1e-6)).all())
    return certified


@pytest.mark.slow
def test_a_training_run_with_the_default_options_is_certified_at_every_step():
    """The default estimator (``"schatten"``) proves its bound at every step — through a ×3
    jump of every weight and a plain ``load_state_dict`` — and that bound covers the exact
    one; the paper's warm power iteration (``estimator="power"``) is certified only at its
    cold start (the first step's forward), a lower bound of σ once the weights moved."""
    events = ("step", "step", "jump", "load", "step")
    assert _certified_per_step(None, events, cover_exact=True) == [True] * 5
    assert _certified_per_step("power") == [True, False, False]


def test_theory_alpha_is_not_certified():
    zoo = models_zoo.get("nanogpt")
    wrapped = geoscale_fx.wrap(zoo.model, compiler="aot_eager", alpha="theory",
                               estimator="exact")
    with torch.no_grad():
        wrapped(**zoo.example_inputs(batch=2, seq_len=16))
    assert not any(r["certified"] for r in geoscale_fx.report(wrapped).rows)


def test_report_of_observed_scaling_has_no_alpha_or_bound():
    """Delayed and current scaling have no α or bound; their rows say so (None)."""
    zoo = models_zoo.get("nanogpt")
    for scaling in ("delayed", "current"):
        wrapped = geoscale_fx.wrap(models_zoo.get("nanogpt").model, compiler="aot_eager",
                                   scaling=scaling)
        with torch.no_grad():
            wrapped(**zoo.example_inputs(batch=2, seq_len=16))
        rows = geoscale_fx.report(wrapped).rows
        assert rows and all(r["alpha"] is None and r["bound"] is None for r in rows)
        assert all(r["scale"] > 0 and r["steps"] == 1 for r in rows)
