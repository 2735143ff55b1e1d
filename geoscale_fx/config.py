"""Options of the geoscale backend: one frozen dataclass, validated on construction.

Example::

    >>> from geoscale_fx.config import GeoscaleOptions
    >>> GeoscaleOptions(alpha="theory", granularity="layer").granularity
    'layer'
    >>> GeoscaleOptions(scaling="fast")
    Traceback (most recent call last):
    ...
    ValueError: scaling must be one of ('geometry', 'delayed', 'current', 'none'), got 'fast'
    >>> GeoscaleOptions(scaling="delayed", alpha="auto")
    Traceback (most recent call last):
    ...
    ValueError: alpha='auto' calibrates the geometry bound; it needs scaling='geometry', got scaling='delayed'
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Union

from geoscale_fx.bounds import FP8_MAX
from geoscale_fx.passes.site_model import ROPE_BOUNDS

__all__ = ["GeoscaleOptions", "CastConfig"]

SCALINGS = ("geometry", "delayed", "current", "none")
GRANULARITIES = ("head", "layer")
ESTIMATORS = ("power", "exact")
ALPHA_POLICIES = ("theory", "auto")
DELAYED_RECIPES = ("paper", "te")
LOWERINGS = ("auto", "fused", "explicit", "fp8_qkv")
COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class CastConfig:
    """How one tensor is cast to FP8 (torchao's ``CastConfig`` in spirit): the logits today;
    q, k and v next. ``scale`` is always a divisor: ``x_fp8 = Q(x / scale)``."""
    target: str                      # "scores" (the softmax input)
    scaling: str                     # "geometry" | "delayed" | "current" | "none"
    fp8_format: str                  # "e4m3" | "e5m2"
    eta: float                       # the scale maps the bound to η·R_max
    granularity: str                 # "head" | "layer"


@dataclass(frozen=True)
class GeoscaleOptions:
    """What the backend does to every attention it can analyse.

    scaling       "geometry" (predict the scale from the weights; default), "delayed"
                  (history of observed maxima, the paper's baseline or TransformerEngine's),
                  "current" (this step's max|S|, materializes S) or "none" (no FP8 at all).
    granularity   "head" (a certified scale per query head; default) or "layer" (the paper's
                  per-layer norm of the concatenated W^Q W^Kᵀ, one scale per layer).
    estimator     "power" (one warm power iteration per step, exact at cold start; default)
                  or "exact" (the certified Gram/eigh route every step).
    alpha         1.0 (worst case: a certified bound; default), any positive float, "theory"
                  (α_min of the paper from δ*, N = layers × heads and the sequence length) or
                  "auto" (calibrated on a burn-in, then frozen).
    eta           margin η: the scale maps the bound to η·R_max (paper: 0.8).
    fp8_format    "e4m3" (R_max = 448) or "e5m2" (57344).
    delta         δ*, the target overflow probability of alpha="theory".
    cold_start_iters  minimum power iterations at cold start (paper: 5); the cold start goes
                  on until the vectors reproduce the exact σ it also computes.
    power_iters   warm power iterations per step (paper: 1).
    audit         also materialize the scores to count overflows, the max scaled logit and
                  utilization (evaluation; forces the explicit lowering).
    delayed_recipe    "paper" (history 16, η 0.9, history initialised to 1.0) or "te"
                  (TransformerEngine DelayedScaling: history 1024 of zeros, margin 0).
    history_len   delayed-scaling history length (None: the recipe's).
    rope_bound    "norm_product" | "relative" | "interaction" (see ``AttentionSite``).
    lowering      "auto" (fused flex_attention where the kernel supports the case, else an
                  explicit attention), "fused", "explicit", or "fp8_qkv" (quantize q, k and v
                  instead of the logits, with descales from the weights' certified amax
                  bounds: FlashAttention-3's FP8 kernel on CUDA, its emulation elsewhere;
                  sites where q/k/v cannot be bounded keep "auto", with the reason logged and
                  reported). Needs scaling="geometry"; α applies to those sites' logits only.
    compiler      "inductor" (default), "aot_eager" (tests: fast, no codegen) or "eager".
    calib_steps, quantile, kappa, alpha0   auto-α (Algorithm 5): burn-in length T_calib,
                  quantile q of the slack ratios, safety multiplier κ ≥ 1, α during burn-in.
    """

    scaling: str = "geometry"
    granularity: str = "head"
    estimator: str = "power"
    alpha: Union[float, str] = 1.0
    eta: float = 0.8
    fp8_format: str = "e4m3"
    delta: float = 1e-6
    cold_start_iters: int = 5
    power_iters: int = 1
    audit: bool = False
    delayed_recipe: str = "paper"
    history_len: Union[int, None] = None
    rope_bound: str = "norm_product"
    lowering: str = "auto"
    compiler: str = "inductor"
    calib_steps: int = 100
    quantile: float = 0.9999
    kappa: float = 1.0
    alpha0: Union[float, str] = "theory"

    def __post_init__(self):
        for name, allowed in (("scaling", SCALINGS), ("granularity", GRANULARITIES),
                              ("estimator", ESTIMATORS), ("fp8_format", tuple(FP8_MAX)),
                              ("delayed_recipe", DELAYED_RECIPES), ("rope_bound", ROPE_BOUNDS),
                              ("lowering", LOWERINGS), ("compiler", COMPILERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        _check_alpha("alpha", self.alpha, ALPHA_POLICIES)
        _check_alpha("alpha0", self.alpha0, ("theory",))
        if not isinstance(self.eta, (int, float)) or not 0.0 < self.eta <= 1.0:
            raise ValueError(f"eta must be in (0, 1], got {self.eta!r}")
        if not isinstance(self.delta, (int, float)) or not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        _check_int("cold_start_iters", self.cold_start_iters, 1)
        _check_int("power_iters", self.power_iters, 1)
        _check_int("calib_steps", self.calib_steps, 1)
        if self.history_len is not None:
            _check_int("history_len", self.history_len, 1)
        if not isinstance(self.quantile, (int, float)) or not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile!r}")
        if not isinstance(self.kappa, (int, float)) or self.kappa < 1.0:
            raise ValueError(f"kappa must be >= 1 (a safety multiplier), got {self.kappa!r}")
        self._cross_validate()

    def _cross_validate(self) -> None:
        """Every option that only means something under another one, checked together."""
        defaults = {f.name: f.default for f in fields(self)}

        def changed(name: str) -> bool:
            return getattr(self, name) != defaults[name]

        if self.alpha == "auto" and self.scaling != "geometry":
            raise ValueError("alpha='auto' calibrates the geometry bound; it needs "
                             f"scaling='geometry', got scaling={self.scaling!r}")
        geometry_only = ("granularity", "estimator", "alpha", "rope_bound", "power_iters",
                         "cold_start_iters")
        if self.scaling != "geometry":
            for name in geometry_only:
                if changed(name):
                    raise ValueError(f"{name}={getattr(self, name)!r} only applies to "
                                     f"scaling='geometry', got scaling={self.scaling!r}")
        if self.scaling != "delayed":
            for name in ("delayed_recipe", "history_len"):
                if changed(name):
                    raise ValueError(f"{name}={getattr(self, name)!r} only applies to "
                                     f"scaling='delayed', got scaling={self.scaling!r}")
        if self.alpha != "auto":
            for name in ("calib_steps", "quantile", "kappa", "alpha0"):
                if changed(name):
                    raise ValueError(f"{name}={getattr(self, name)!r} only applies to "
                                     f"alpha='auto', got alpha={self.alpha!r}")
        if self.rope_bound == "relative":
            raise ValueError("rope_bound='relative' is an analysis option "
                             "(find_attention(..., rope_bound=...) / site.with_rope_bound); the "
                             "backend takes 'norm_product' or 'interaction', got "
                             "rope_bound='relative' with scaling=" + repr(self.scaling))
        if self.lowering == "fp8_qkv":
            if self.scaling != "geometry":
                raise ValueError("lowering='fp8_qkv' predicts the q/k/v scales from the "
                                 f"weights; it needs scaling='geometry', got "
                                 f"scaling={self.scaling!r}")
            if self.audit or self.alpha == "auto":
                reason = "audit=True" if self.audit else "alpha='auto'"
                raise ValueError(f"lowering='fp8_qkv' never materializes the logits, but "
                                 f"{reason} observes them; use lowering='auto' or 'explicit'")
        if self.lowering == "fused" and self.materializes_scores:
            reason = "audit=True" if self.audit else f"scaling={self.scaling!r}"
            raise ValueError(f"lowering='fused' never materializes the scores, but {reason} "
                             "observes max|S| every step; use lowering='auto' or 'explicit'")

    @property
    def scores(self) -> CastConfig:
        """The cast of the softmax input."""
        return CastConfig("scores", self.scaling, self.fp8_format, self.eta, self.granularity)

    @property
    def delayed_history_len(self) -> int:
        if self.history_len is not None:
            return self.history_len
        return 16 if self.delayed_recipe == "paper" else 1024

    @property
    def materializes_scores(self) -> bool:
        """Whether S must exist in memory at every step (observed-max scaling or an audit).

        Auto-α materializes S only during its burn-in (see ``GeoscaleBackend``)."""
        return self.audit or self.scaling in ("delayed", "current")

    def replace(self, **changes) -> "GeoscaleOptions":
        return replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "GeoscaleOptions":
        """Options from keyword arguments, with a clear error for an unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown geoscale option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def _check_alpha(name: str, value, policies) -> None:
    if isinstance(value, str):
        if value not in policies:
            raise ValueError(f"{name} must be a positive number or one of {policies}, "
                             f"got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number or one of {policies}, got {value!r}")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
