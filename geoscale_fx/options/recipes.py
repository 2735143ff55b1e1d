"""Scaling recipes: one frozen object per strategy, holding only the options it reads.

The recipe spelling of ``GeoscaleOptions`` (as TransformerEngine's ``DelayedScaling`` /
``Float8CurrentScaling`` and torchao's ``Float8LinearConfig``): an option that another strategy
would ignore cannot be written, and a value outside its domain is a ``ValueError`` naming the
field and the allowed values.

* ``GeometryRecipe``: the scale predicted from the weights, s = η·R_max / (α·B), B the
  certified bound on |S| from σ(W^Q W^Kᵀ), α an ``Alpha``;
* ``DelayedRecipe``: a history of observed max|S| (the paper's baseline or TransformerEngine's);
* ``CurrentRecipe``: this step's max|S| (materializes S);
* ``NoScalingRecipe``: no FP8 at all.

``recipe.flat()`` is the recipe as ``GeoscaleOptions`` keywords and ``recipe_of(options)`` the
way back; ``GeoscaleOptions.from_recipe`` adds what is not a strategy (quantize, kernel, audit,
compiler, kv_cache).

Example::

    >>> from geoscale_fx.options.recipes import Alpha, GeometryRecipe
    >>> GeometryRecipe(alpha=Alpha("theory", delta=1e-3)).flat()["delta"]
    0.001
    >>> Alpha(0.5, delta=1e-3)
    Traceback (most recent call last):
    ...
    ValueError: Alpha.delta=0.001 only applies to Alpha('theory') or Alpha('auto', alpha0='theory'), got Alpha.value=0.5
    >>> GeometryRecipe(estimator="exact", power_iters=2)
    Traceback (most recent call last):
    ...
    ValueError: GeometryRecipe.power_iters=2 only applies to estimator='power', got GeometryRecipe.estimator='exact'
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Optional, Union

from geoscale_fx.core.bounds import FP8_MAX

__all__ = ["Alpha", "GeometryRecipe", "DelayedRecipe", "CurrentRecipe", "NoScalingRecipe",
           "RECIPES", "recipe_of"]

GRANULARITIES = ("head", "layer")
ESTIMATORS = ("schatten", "exact", "power")
ALPHA_POLICIES = ("theory", "auto")
DELAYED_RECIPES = ("paper", "te")
FP8_FORMATS = tuple(FP8_MAX)
#: RoPE bounds the backend computes per step (the analysis' ``ROPE_BOUNDS`` also has
#: "relative", an exact maximum over relative positions that is evaluated on the host only)
BACKEND_ROPE_BOUNDS = ("norm_product", "interaction")


# --------------------------------------------------------------------------------------
# Field checks (shared with ``config.GeoscaleOptions``): each names the field
# --------------------------------------------------------------------------------------

def check_one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_alpha(name: str, value, policies) -> None:
    if isinstance(value, str):
        if value not in policies:
            raise ValueError(f"{name} must be a positive number or one of {policies}, "
                             f"got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number or one of {policies}, got {value!r}")


def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_eta(name: str, value) -> None:
    if not _is_number(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def check_delta(name: str, value) -> None:
    if not _is_number(value) or not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


def check_quantile(name: str, value) -> None:
    if not _is_number(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def check_kappa(name: str, value) -> None:
    if not _is_number(value) or value < 1.0:
        raise ValueError(f"{name} must be >= 1 (a safety multiplier), got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_alpha(value) -> Alpha:
    """``GeometryRecipe(alpha=0.5)`` / ``alpha="theory"``: the ``Alpha`` of that value."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        try:
            return Alpha(value)
        except ValueError:
            pass
    raise ValueError("GeometryRecipe.alpha must be an Alpha, a positive number or one of "
                     f"{ALPHA_POLICIES}, got {value!r}")


def refuse_changed(options, names, needs: str, by: str, label: str = "") -> None:
    """A ``ValueError`` for the first of ``names`` set away from its dataclass default: it
    only applies to ``needs``, which field ``by`` rules out (``label``: the prefix the
    message names fields with, e.g. ``"GeometryRecipe."``; flat options use none)."""
    defaults = {f.name: f.default for f in fields(options)}
    for name in names:
        if getattr(options, name) != defaults[name]:
            raise ValueError(f"{label}{name}={getattr(options, name)!r} only applies to "
                             f"{needs}, got {label}{by}={getattr(options, by)!r}")


def check_estimator_choices(options, label: str = "") -> None:
    """The geometry estimator's fields that another one rules out (the flat options and
    ``GeometryRecipe`` share the names): iterations of the power estimator, the RoPE bound
    of per-head granularity."""
    if options.estimator != "power":
        refuse_changed(options, ("power_iters", "cold_start_iters"), "estimator='power'",
                       "estimator", label)
    if options.granularity == "layer":
        refuse_changed(options, ("rope_bound",), "granularity='head' (per layer the bound "
                       "is the position-independent σ already)", "granularity", label)


# --------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alpha:
    """α: the bound the scale maps to η·R_max is α·B (B the certified bound on |S|).

    value        1.0 (worst case: certified; default), any positive number, "theory" (α_min
                 of the paper from δ*, N = layers × heads and the sequence length) or "auto"
                 (Algorithm 5: calibrated on a burn-in, then frozen).
    delta        δ*, the target overflow probability of α_min: value "theory", or "auto"
                 whose burn-in alpha0 is "theory".
    calib_steps, quantile, kappa, alpha0   value "auto" only: burn-in length T_calib,
                 quantile q of the slack ratios, safety multiplier κ ≥ 1, α during the
                 burn-in (a positive number or "theory").
    """

    value: Union[float, str] = 1.0
    delta: float = 1e-6
    calib_steps: int = 100
    quantile: float = 0.9999
    kappa: float = 1.0
    alpha0: Union[float, str] = "theory"

    def __post_init__(self):
        check_alpha("Alpha.value", self.value, ALPHA_POLICIES)
        check_alpha("Alpha.alpha0", self.alpha0, ("theory",))
        check_delta("Alpha.delta", self.delta)
        check_int("Alpha.calib_steps", self.calib_steps, 1)
        check_quantile("Alpha.quantile", self.quantile)
        check_kappa("Alpha.kappa", self.kappa)
        if self.value != "auto":
            refuse_changed(self, ("calib_steps", "quantile", "kappa", "alpha0"),
                           "Alpha('auto')", "value", "Alpha.")
        policy = self.alpha0 if self.value == "auto" else self.value
        if policy != "theory":
            refuse_changed(self, ("delta",),
                           "Alpha('theory') or Alpha('auto', alpha0='theory')",
                           "alpha0" if self.value == "auto" else "value", "Alpha.")


@dataclass(frozen=True)
class GeometryRecipe:
    """Scales predicted from the weights' geometry (the default strategy).

    granularity   "head" (a certified scale per query head) or "layer" (the paper's σ of the
                  concatenated W^Q W^Kᵀ, one scale per layer).
    estimator     "schatten" (default: a certified upper bound of σ every step, its Schatten
                  norm by repeated squaring, matmuls only), "exact" (the certified Gram/eigh
                  route every step) or "power" (the paper's one warm power iteration per
                  step, exact at cold start: a lower bound of σ once the weights move, not
                  certified).
    alpha         an ``Alpha`` (a plain number, "theory" or "auto" is read as ``Alpha(it)``).
    eta           margin η ∈ (0, 1]: the scale maps α·B to η·R_max (paper: 0.8).
    rope_bound    "norm_product" (certified) or "interaction" (the paper's; per head only).
    power_iters, cold_start_iters   warm iterations per step, minimum cold-start iterations
                  (estimator "power" only).
    fp8_format    "e4m3" (R_max = 448) or "e5m2" (57344).
    """

    scaling: ClassVar[str] = "geometry"
    granularity: str = "head"
    estimator: str = "schatten"
    alpha: Alpha = Alpha()
    eta: float = 0.8
    rope_bound: str = "norm_product"
    power_iters: int = 1
    cold_start_iters: int = 5
    fp8_format: str = "e4m3"

    def __post_init__(self):
        if not isinstance(self.alpha, Alpha):
            object.__setattr__(self, "alpha", _as_alpha(self.alpha))
        if self.rope_bound == "relative":
            raise ValueError("GeometryRecipe.rope_bound='relative' is an analysis option "
                             "(find_attention(..., rope_bound=...)); the backend takes one of "
                             f"{BACKEND_ROPE_BOUNDS}")
        check_one_of("GeometryRecipe.granularity", self.granularity, GRANULARITIES)
        check_one_of("GeometryRecipe.estimator", self.estimator, ESTIMATORS)
        check_one_of("GeometryRecipe.rope_bound", self.rope_bound, BACKEND_ROPE_BOUNDS)
        check_one_of("GeometryRecipe.fp8_format", self.fp8_format, FP8_FORMATS)
        check_eta("GeometryRecipe.eta", self.eta)
        check_int("GeometryRecipe.power_iters", self.power_iters, 1)
        check_int("GeometryRecipe.cold_start_iters", self.cold_start_iters, 1)
        check_estimator_choices(self, "GeometryRecipe.")

    def flat(self) -> dict:
        a = self.alpha
        return dict(scaling=self.scaling, granularity=self.granularity,
                    estimator=self.estimator, alpha=a.value, delta=a.delta,
                    calib_steps=a.calib_steps, quantile=a.quantile, kappa=a.kappa,
                    alpha0=a.alpha0, eta=self.eta, rope_bound=self.rope_bound,
                    power_iters=self.power_iters, cold_start_iters=self.cold_start_iters,
                    fp8_format=self.fp8_format)


@dataclass(frozen=True)
class DelayedRecipe:
    """Scales from a history of observed max|S| (materializes S every step).

    preset        "paper" (history 16, η 0.9, history initialised to 1.0) or "te"
                  (TransformerEngine's DelayedScaling: history 1024 of zeros, margin 0).
    history_len   the history's length (None: the preset's).
    fp8_format    "e4m3" or "e5m2".
    """

    scaling: ClassVar[str] = "delayed"
    preset: str = "paper"
    history_len: Optional[int] = None
    fp8_format: str = "e4m3"

    def __post_init__(self):
        check_one_of("DelayedRecipe.preset", self.preset, DELAYED_RECIPES)
        if self.history_len is not None:
            check_int("DelayedRecipe.history_len", self.history_len, 1)
        check_one_of("DelayedRecipe.fp8_format", self.fp8_format, FP8_FORMATS)

    def flat(self) -> dict:
        return dict(scaling=self.scaling, delayed_recipe=self.preset,
                    history_len=self.history_len, fp8_format=self.fp8_format)


@dataclass(frozen=True)
class CurrentRecipe:
    """Scales from this step's max|S| (materializes S every step). fp8_format as above."""

    scaling: ClassVar[str] = "current"
    fp8_format: str = "e4m3"

    def __post_init__(self):
        check_one_of("CurrentRecipe.fp8_format", self.fp8_format, FP8_FORMATS)

    def flat(self) -> dict:
        return dict(scaling=self.scaling, fp8_format=self.fp8_format)


@dataclass(frozen=True)
class NoScalingRecipe:
    """No FP8: the sites are rewritten but nothing is cast (a reference run)."""

    scaling: ClassVar[str] = "none"

    def flat(self) -> dict:
        return dict(scaling=self.scaling)


RECIPES = (GeometryRecipe, DelayedRecipe, CurrentRecipe, NoScalingRecipe)

#: every ``GeoscaleOptions`` keyword that a recipe spells (the others: audit, lowering,
#: compiler, kv_cache)
RECIPE_KEYWORDS = frozenset(GeometryRecipe().flat()) | frozenset(DelayedRecipe().flat())


def recipe_of(flat) -> Union[GeometryRecipe, DelayedRecipe, CurrentRecipe, NoScalingRecipe]:
    """The recipe that ``flat`` (a ``GeoscaleOptions`` or anything with its attributes) spells."""
    if flat.scaling == "geometry":
        alpha = Alpha(flat.alpha, delta=flat.delta, calib_steps=flat.calib_steps,
                      quantile=flat.quantile, kappa=flat.kappa, alpha0=flat.alpha0)
        return GeometryRecipe(granularity=flat.granularity, estimator=flat.estimator,
                              alpha=alpha, eta=flat.eta, rope_bound=flat.rope_bound,
                              power_iters=flat.power_iters,
                              cold_start_iters=flat.cold_start_iters,
                              fp8_format=flat.fp8_format)
    if flat.scaling == "delayed":
        return DelayedRecipe(preset=flat.delayed_recipe, history_len=flat.history_len,
                             fp8_format=flat.fp8_format)
    if flat.scaling == "current":
        return CurrentRecipe(fp8_format=flat.fp8_format)
    return NoScalingRecipe()
