"""The cross-option rules of ``GeoscaleOptions`` and of a recipe with quantize / kernel / audit.

The rule (``geoscale_fx.options.config``): an option set away from its default either takes effect or
is a ``ValueError`` naming it and the option it depends on. ``check_option_rules`` checks the
flat options together (run by ``GeoscaleOptions.__post_init__``); ``check_recipe_use``
checks a recipe of ``geoscale_fx.options.recipes`` against what is quantized, the kernel and audit
(run by ``GeoscaleOptions.from_recipe``).

    >>> from geoscale_fx.options.config import GeoscaleOptions
    >>> GeoscaleOptions(estimator="exact", power_iters=3)
    Traceback (most recent call last):
    ...
    ValueError: power_iters=3 only applies to estimator='power', got estimator='exact'
"""
from __future__ import annotations

from dataclasses import fields

from geoscale_fx.options.recipes import (CurrentRecipe, DelayedRecipe, GeometryRecipe, NoScalingRecipe,
                                 check_estimator_choices, refuse_changed)

__all__ = ["check_option_rules", "check_recipe_use"]

#: options read only by the geometry policy (``scaling.GeometryScaling``, the fp8_qkv
#: descales for eta and granularity)
_GEOMETRY_ONLY = ("granularity", "estimator", "alpha", "eta", "rope_bound", "power_iters",
                  "cold_start_iters")
#: options read only by the logit bound's estimators and α: an fp8_qkv site reads none of them
#: (the power estimator's iterations first: with them set, the estimator is set too)
_LOGIT_BOUND_ONLY = ("power_iters", "cold_start_iters", "estimator", "alpha", "rope_bound")


def check_option_rules(options) -> None:
    """Every option that only means something under another one, checked together: a
    ``ValueError`` naming the option set and the one it depends on."""
    if options.alpha == "auto" and options.scaling != "geometry":
        raise ValueError("alpha='auto' calibrates the geometry bound; it needs "
                         f"scaling='geometry', got scaling={options.scaling!r}")
    if options.scaling != "geometry":
        refuse_changed(options, _GEOMETRY_ONLY, "scaling='geometry'", "scaling")
    if options.scaling != "delayed":
        refuse_changed(options, ("delayed_recipe", "history_len"), "scaling='delayed'",
                        "scaling")
    if options.scaling == "none":
        refuse_changed(options, ("fp8_format", "audit"), "a scaling that casts to FP8",
                        "scaling")
    if options.alpha != "auto":
        refuse_changed(options, ("calib_steps", "quantile", "kappa", "alpha0"),
                        "alpha='auto'", "alpha")
    alpha_policy = options.alpha0 if options.alpha == "auto" else options.alpha
    if alpha_policy != "theory":
        where = "alpha0" if options.alpha == "auto" else "alpha"
        refuse_changed(options, ("delta",), "alpha='theory' (or alpha='auto' with "
                        "alpha0='theory')", where)
    if options.lowering == "fp8_qkv":      # before the estimator's own choices: it reads none
        _check_fp8_qkv(options)
    check_estimator_choices(options)
    if options.lowering == "fused" and options.materializes_scores:
        reason = "audit=True" if options.audit else f"scaling={options.scaling!r}"
        raise ValueError("lowering='fused' (kernel='fused') never materializes the "
                         f"scores, but {reason} observes max|S| every step; use "
                         "lowering='auto' or 'explicit'")


def _check_fp8_qkv(options) -> None:
    """lowering='fp8_qkv': geometry scaling, no observed logits, no logit-bound option."""
    if options.scaling != "geometry":
        raise ValueError("lowering='fp8_qkv' (quantize='qkv') predicts the q/k/v scales "
                         "from the weights; it needs scaling='geometry', got "
                         f"scaling={options.scaling!r}")
    if options.audit or options.alpha == "auto":
        reason = "audit=True" if options.audit else "alpha='auto'"
        raise ValueError("lowering='fp8_qkv' (quantize='qkv') never materializes the "
                         f"logits, but {reason} observes them; use lowering='auto' or "
                         "'explicit'")
    for name in _LOGIT_BOUND_ONLY:
        if _changed(options, name):
            raise ValueError(f"{name}={getattr(options, name)!r} sets the logit bound, which "
                             "lowering='fp8_qkv' (quantize='qkv') does not use (its "
                             "descales come from the q/k/v amax bounds; sites that fall "
                             "back keep the certified "
                             "defaults); use lowering='auto' or 'explicit'")


def _changed(options, name: str) -> bool:
    """Whether ``name`` is set away from its default."""
    return getattr(options, name) != _default(options, name)


def _default(options, name: str):
    return next(f.default for f in fields(options) if f.name == name)


def check_recipe_use(recipe, quantize: str, kernel: str, audit: bool, q_label: str,
                     k_label: str) -> None:
    """A recipe against what is quantized, the kernel and audit: each refusal names both."""
    name = f"recipe={type(recipe).__name__}(...)"
    if audit and isinstance(recipe, NoScalingRecipe):
        raise ValueError(f"audit=True counts FP8 overflows, but {name} casts nothing to FP8")
    if quantize == "qkv":
        if not isinstance(recipe, GeometryRecipe):
            raise ValueError(f"{q_label} predicts the q/k/v scales from the weights; it needs "
                             f"recipe=GeometryRecipe(...), got {name}")
        if audit or recipe.alpha.value == "auto":
            reason = "audit=True" if audit else "GeometryRecipe.alpha=Alpha('auto')"
            raise ValueError(f"{q_label} never materializes the logits, but {reason} "
                             "observes them; use quantize='scores'")
        default = GeometryRecipe()
        for field in _LOGIT_BOUND_ONLY:
            if getattr(recipe, field) != getattr(default, field):
                raise ValueError(f"GeometryRecipe.{field}={getattr(recipe, field)!r} sets the "
                                 f"logit bound, which {q_label} does not use (its descales "
                                 "come from the q/k/v amax bounds); use quantize='scores'")
    if kernel == "fused" and (audit or isinstance(recipe, (DelayedRecipe, CurrentRecipe))):
        reason = "audit=True" if audit else name
        raise ValueError(f"{k_label} never materializes the scores, but {reason} observes "
                         "max|S| every step; use kernel='auto' or 'explicit'")
