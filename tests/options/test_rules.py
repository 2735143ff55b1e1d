"""``geoscale_fx.options.rules``: each cross-option rule called directly, on options built
without ``GeoscaleOptions.__post_init__`` (so the rule under test is the one that refuses),
and on recipes: a refusal is a ``ValueError`` naming the option set and the one it depends
on; a combination that takes effect passes. tests/options/test_config.py and tests/options/test_recipes.py
check the same rules through the constructors, over products of options."""
from __future__ import annotations

import copy

import pytest

from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.options.rules import check_option_rules, check_recipe_use
from geoscale_fx.options.recipes import (Alpha, CurrentRecipe, DelayedRecipe, GeometryRecipe,
                                 NoScalingRecipe)

#: a value away from the default for each option a rule may refuse
CHANGED = {"granularity": "layer", "estimator": "power", "alpha": 2.0, "eta": 0.5,
           "rope_bound": "interaction", "power_iters": 3, "cold_start_iters": 7,
           "delayed_recipe": "te", "history_len": 8, "fp8_format": "e5m2", "audit": True,
           "calib_steps": 10, "quantile": 0.99, "kappa": 2.0, "alpha0": 0.5, "delta": 1e-3}
LABELS = ("quantize='qkv'", "kernel='fused'")


def _unchecked(**changes) -> GeoscaleOptions:
    """Default options with ``changes`` set as they are (no rule has run on them)."""
    options = copy.copy(GeoscaleOptions())
    for name, value in changes.items():
        object.__setattr__(options, name, value)
    return options


def _refused(options, *names: str) -> str:
    with pytest.raises(ValueError) as info:
        check_option_rules(options)
    message = str(info.value)
    assert all(name in message for name in names), (names, message)
    return message


def test_the_defaults_and_options_that_take_effect_pass():
    for options in (_unchecked(), _unchecked(scaling="delayed", history_len=8),
                    _unchecked(alpha="auto", calib_steps=10, alpha0=0.5),
                    _unchecked(alpha="theory", delta=1e-3),
                    _unchecked(lowering="fp8_qkv", eta=0.5, granularity="layer"),
                    _unchecked(lowering="fused", scaling="geometry")):
        assert check_option_rules(options) is None


@pytest.mark.parametrize("name", ["granularity", "estimator", "alpha", "eta", "rope_bound",
                                  "power_iters", "cold_start_iters"])
@pytest.mark.parametrize("scaling", ["delayed", "current", "none"])
def test_geometry_options_need_geometry_scaling(name, scaling):
    message = _refused(_unchecked(scaling=scaling, **{name: CHANGED[name]}),
                       f"{name}={CHANGED[name]!r}", f"scaling={scaling!r}")
    assert "scaling='geometry'" in message


@pytest.mark.parametrize("name", ["delayed_recipe", "history_len"])
def test_delayed_options_need_delayed_scaling(name):
    _refused(_unchecked(scaling="current", **{name: CHANGED[name]}),
             f"{name}={CHANGED[name]!r}", "scaling='delayed'", "scaling='current'")


@pytest.mark.parametrize("name", ["fp8_format", "audit"])
def test_casting_options_need_a_scaling_that_casts(name):
    _refused(_unchecked(scaling="none", **{name: CHANGED[name]}),
             f"{name}={CHANGED[name]!r}", "scaling='none'")


@pytest.mark.parametrize("name", ["calib_steps", "quantile", "kappa", "alpha0"])
def test_calibration_options_need_auto_alpha(name):
    _refused(_unchecked(**{name: CHANGED[name]}), f"{name}={CHANGED[name]!r}",
             "alpha='auto'", "alpha=1.0")


def test_auto_alpha_needs_geometry_and_delta_needs_a_theory_alpha():
    _refused(_unchecked(alpha="auto", scaling="current"), "alpha='auto'",
             "scaling='current'")
    _refused(_unchecked(delta=1e-3), "delta=0.001", "alpha='theory'", "alpha=1.0")
    # under auto-α the theory policy is alpha0's: the refusal names alpha0, not alpha
    _refused(_unchecked(alpha="auto", alpha0=0.5, delta=1e-3), "delta=0.001", "alpha0=0.5")


def test_estimator_choices_are_checked_with_the_rest():
    _refused(_unchecked(estimator="exact", power_iters=3), "power_iters=3",
             "estimator='exact'")
    _refused(_unchecked(granularity="layer", rope_bound="interaction"),
             "rope_bound='interaction'", "granularity='layer'")


@pytest.mark.parametrize("name", ["estimator", "alpha", "rope_bound", "power_iters",
                                  "cold_start_iters"])
def test_fp8_qkv_refuses_every_logit_bound_option(name):
    message = _refused(_unchecked(lowering="fp8_qkv", **{name: CHANGED[name]}),
                       f"{name}={CHANGED[name]!r}", "lowering='fp8_qkv'")
    assert "sets the logit bound" in message


def test_fp8_qkv_needs_geometry_and_no_observed_logits():
    _refused(_unchecked(lowering="fp8_qkv", scaling="delayed"), "lowering='fp8_qkv'",
             "scaling='delayed'")
    _refused(_unchecked(lowering="fp8_qkv", audit=True), "lowering='fp8_qkv'", "audit=True")
    _refused(_unchecked(lowering="fp8_qkv", alpha="auto"), "lowering='fp8_qkv'",
             "alpha='auto'")


@pytest.mark.parametrize("changes, reason", [(dict(audit=True), "audit=True"),
                                             (dict(scaling="delayed"), "scaling='delayed'"),
                                             (dict(scaling="current"), "scaling='current'")])
def test_the_fused_kernel_refuses_what_observes_the_scores(changes, reason):
    _refused(_unchecked(lowering="fused", **changes), "lowering='fused'", reason)


# ---- a recipe against quantize / kernel / audit ----------------------------------------

def _recipe_refused(recipe, quantize="scores", kernel="auto", audit=False) -> str:
    with pytest.raises(ValueError) as info:
        check_recipe_use(recipe, quantize, kernel, audit, *LABELS)
    return str(info.value)


@pytest.mark.parametrize("recipe, quantize, kernel, audit", [
    (GeometryRecipe(), "qkv", "auto", False),
    (GeometryRecipe(eta=0.5, granularity="layer"), "qkv", "auto", False),
    (GeometryRecipe(), "scores", "fused", False),
    (DelayedRecipe(), "scores", "explicit", True),
    (NoScalingRecipe(), "scores", "fused", False)])
def test_recipe_uses_that_take_effect_pass(recipe, quantize, kernel, audit):
    assert check_recipe_use(recipe, quantize, kernel, audit, *LABELS) is None


def test_audit_needs_a_recipe_that_casts():
    message = _recipe_refused(NoScalingRecipe(), audit=True)
    assert "audit=True" in message and "recipe=NoScalingRecipe(...)" in message


@pytest.mark.parametrize("recipe", [DelayedRecipe(), CurrentRecipe(), NoScalingRecipe()])
def test_qkv_needs_a_geometry_recipe(recipe):
    message = _recipe_refused(recipe, quantize="qkv")
    assert message.startswith("quantize='qkv' predicts the q/k/v scales")
    assert f"recipe={type(recipe).__name__}(...)" in message


def test_qkv_refuses_observed_logits_and_logit_bound_fields():
    assert "GeometryRecipe.alpha=Alpha('auto')" in _recipe_refused(
        GeometryRecipe(alpha=Alpha("auto")), quantize="qkv")
    assert "audit=True" in _recipe_refused(GeometryRecipe(), quantize="qkv", audit=True)
    for field, value in (("estimator", "power"), ("rope_bound", "interaction"),
                         ("power_iters", 3), ("cold_start_iters", 7)):
        power = {"estimator": "power"} if field.endswith("_iters") else {}
        message = _recipe_refused(GeometryRecipe(**power, **{field: value}), quantize="qkv")
        assert f"GeometryRecipe.{field}={value!r} sets the logit bound" in message
        assert "quantize='qkv'" in message


@pytest.mark.parametrize("recipe, audit, reason", [
    (DelayedRecipe(), False, "recipe=DelayedRecipe(...)"),
    (CurrentRecipe(), False, "recipe=CurrentRecipe(...)"),
    (GeometryRecipe(), True, "audit=True")])
def test_the_fused_kernel_refuses_recipes_that_observe_the_scores(recipe, audit, reason):
    message = _recipe_refused(recipe, kernel="fused", audit=audit)
    assert message.startswith("kernel='fused' never materializes the scores")
    assert reason in message
