"""Options of the geoscale backend: one frozen dataclass, validated on construction.

The rule: an option a user sets away from its default either takes effect or is a
``ValueError`` naming it (and the option it depends on). Nothing is silently ignored.

Example::

    >>> from geoscale_fx.options.config import GeoscaleOptions
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
    >>> GeoscaleOptions(scaling="delayed", eta=0.5)
    Traceback (most recent call last):
    ...
    ValueError: eta=0.5 only applies to scaling='geometry', got scaling='delayed'

The recipe spelling (``geoscale_fx.options.recipes``: one object per strategy holding only its own
fields) builds the same options; ``quantize`` ("scores" | "qkv") and ``kernel`` ("auto" |
"fused" | "explicit") are the two choices ``lowering`` encodes ("fp8_qkv" is quantize="qkv").
The constructor takes the flat keywords; ``from_recipe`` and ``from_kwargs(recipe=...)`` (what
``backend``, ``wrap`` and ``apply_`` call) take a recipe, and ``.recipe`` gives it back::

    >>> from geoscale_fx.options.recipes import Alpha, GeometryRecipe
    >>> o = GeoscaleOptions.from_recipe(GeometryRecipe(alpha=Alpha("theory")), kernel="explicit")
    >>> o == GeoscaleOptions(alpha="theory", lowering="explicit"), o.recipe.alpha.value
    (True, 'theory')
    >>> GeoscaleOptions.from_kwargs(recipe=GeometryRecipe(), eta=0.5)
    Traceback (most recent call last):
    ...
    ValueError: recipe=GeometryRecipe(...) and ['eta'] set the same options; set ['eta'] in the recipe or leave recipe= out
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Union

from geoscale_fx.core.bounds import FP8_MAX
from geoscale_fx.core.fp8 import kv_format
from geoscale_fx.options.rules import check_option_rules, check_recipe_use
from geoscale_fx.options.recipes import (ALPHA_POLICIES, BACKEND_ROPE_BOUNDS, DELAYED_RECIPES,
                                 ESTIMATORS, GRANULARITIES, RECIPE_KEYWORDS, RECIPES,
                                 check_alpha, check_delta, check_eta, check_int, check_kappa,
                                 check_one_of, check_quantile, recipe_of)

__all__ = ["GeoscaleOptions", "BACKEND_ROPE_BOUNDS", "lowering_of"]

SCALINGS = ("geometry", "delayed", "current", "none")
LOWERINGS = ("auto", "fused", "explicit", "fp8_qkv")
#: what is cast to FP8: the logits S ("scores") or the attention's operands q, k, v ("qkv")
QUANTIZE = ("scores", "qkv")
#: how a site whose logits are quantized is lowered ("auto": the plan decides per site)
KERNELS = ("auto", "fused", "explicit")
COMPILERS = ("inductor", "aot_eager", "eager")

@dataclass(frozen=True)
class GeoscaleOptions:
    """What the backend does to every attention it can analyse.

    scaling       "geometry" (predict the scale from the weights; default), "delayed"
                  (history of observed maxima, the paper's baseline or TransformerEngine's),
                  "current" (this step's max|S|, materializes S) or "none" (no FP8 at all).
    granularity   "head" (a certified scale per query head; default) or "layer" (the paper's
                  per-layer norm of the concatenated W^Q W^Kᵀ, one scale per layer; with
                  lowering="fp8_qkv" one descale per tensor). Geometry only.
    estimator     "schatten" (default: a certified upper bound of σ every step, the
                  Schatten-256 norm by repeated squaring of d_h×d_h matrices, at most
                  rank^(1/256) above σ; at the zoo's scale a training step costs what the
                  power iteration's does, ``python -m bench.certified_cost``), "exact" (the
                  certified Gram/eigh route every step) or "power" (the paper's: one warm
                  power iteration per step, exact at cold start; a lower bound of σ once
                  the weights move, not certified).
    alpha         1.0 (worst case: a certified bound; default), any positive float, "theory"
                  (α_min of the paper from δ*, N = layers × heads and the sequence length) or
                  "auto" (calibrated on a burn-in, then frozen). Geometry only.
    eta           margin η: the scale maps the bound to η·R_max (paper: 0.8). Geometry only
                  (the delayed recipes carry their own margins; current scaling has none).
    fp8_format    "e4m3" (R_max = 448) or "e5m2" (57344); not with scaling="none".
    delta         δ*, the target overflow probability of α_min: only with alpha="theory", or
                  alpha="auto" whose burn-in α0 is "theory".
    cold_start_iters  minimum power iterations at cold start (paper: 5); the cold start goes
                  on until the vectors reproduce the exact σ it also computes. Power only.
    power_iters   warm power iterations per step (paper: 1). Power only.
    audit         also materialize the scores to count overflows, the max scaled logit and
                  utilization (evaluation; forces the explicit lowering). The delayed and
                  current policies observe max|S| anyway; not with scaling="none" (no FP8).
    delayed_recipe    "paper" (history 16, η 0.9, history initialised to 1.0) or "te"
                  (TransformerEngine DelayedScaling: history 1024 of zeros, margin 0).
    history_len   delayed-scaling history length (None: the recipe's).
    rope_bound    "norm_product" (certified) or "interaction" (the paper's, per head; see
                  ``AttentionSite``). Per layer the bound is already the position-independent
                  σ, so "interaction" needs granularity="head". "relative" is an analysis
                  option only (``find_attention(..., rope_bound="relative")``).
    lowering      "auto" (fused flex_attention where the kernel supports the case and the
                  compiler is Inductor — the only one that fuses it —, else an explicit
                  attention), "fused", "explicit", or "fp8_qkv" (quantize q, k and v
                  instead of the logits, with descales from the weights' certified amax
                  bounds: FlashAttention-3's FP8 kernel on CUDA, its emulation elsewhere).
                  fp8_qkv needs scaling="geometry" and takes eta, fp8_format and granularity;
                  the logit bound's options (alpha, delta, estimator, rope_bound, power_iters,
                  cold_start_iters) are refused with it: a site whose q/k/v cannot be bounded
                  keeps a logit lowering with the certified defaults (α = 1), the reason
                  logged and reported.
    compiler      "inductor" (default), "aot_eager" (tests: fast, no codegen) or "eager".
    calib_steps, quantile, kappa, alpha0   auto-α (Algorithm 5): burn-in length T_calib,
                  quantile q of the slack ratios, safety multiplier κ ≥ 1, α during burn-in.
    kv_cache      None (the model's own cache; default) or an FP8 KV cache for ``generate``
                  whose per-kv-head scales come from the weights: the values
                  ``geoscale_fx.core.fp8.KV_CACHE_FORMATS`` lists ("fp8", "fp8_e4m3", "fp8_e5m2",
                  "nvfp4"). Read by ``wrap`` and ``apply_``, which refuse it for a model without
                  Hugging Face ``generate``.

    The recipe spelling: ``GeoscaleOptions.from_recipe(recipe, quantize=, kernel=, audit=,
    compiler=, kv_cache=)`` with a recipe of ``geoscale_fx.options.recipes`` for scaling and the
    options of its strategy; ``.recipe``, ``.quantize`` and ``.kernel`` read them back.
    """

    scaling: str = "geometry"
    granularity: str = "head"
    estimator: str = "schatten"
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
    kv_cache: Optional[str] = None

    def __post_init__(self):
        if self.rope_bound == "relative":
            raise ValueError("rope_bound='relative' is an analysis option "
                             "(find_attention(..., rope_bound=...) / site.with_rope_bound); the "
                             f"backend takes one of {BACKEND_ROPE_BOUNDS}, got "
                             "rope_bound='relative'")
        for name, allowed in (("scaling", SCALINGS), ("granularity", GRANULARITIES),
                              ("estimator", ESTIMATORS), ("fp8_format", tuple(FP8_MAX)),
                              ("delayed_recipe", DELAYED_RECIPES),
                              ("rope_bound", BACKEND_ROPE_BOUNDS),
                              ("lowering", LOWERINGS), ("compiler", COMPILERS)):
            check_one_of(name, getattr(self, name), allowed)
        check_alpha("alpha", self.alpha, ALPHA_POLICIES)
        check_alpha("alpha0", self.alpha0, ("theory",))
        check_eta("eta", self.eta)
        check_delta("delta", self.delta)
        check_int("cold_start_iters", self.cold_start_iters, 1)
        check_int("power_iters", self.power_iters, 1)
        check_int("calib_steps", self.calib_steps, 1)
        if self.history_len is not None:
            check_int("history_len", self.history_len, 1)
        check_quantile("quantile", self.quantile)
        check_kappa("kappa", self.kappa)
        if self.kv_cache is not None:
            kv_format(self.kv_cache)
        check_option_rules(self)

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

    def without_kv_cache(self, entry: str) -> "GeoscaleOptions":
        """These options for an entry point that compiles graphs only (``backend``,
        ``compile_blocks``): the FP8 KV cache lives in ``generate``, which only ``wrap`` and
        ``apply_`` take over, so ``kv_cache`` set here is a ValueError naming ``entry``."""
        if self.kv_cache is not None:
            raise ValueError(f"kv_cache={self.kv_cache!r}: {entry} compiles graphs and never "
                             "runs generate, which keeps the KV cache; use "
                             "geoscale_fx.apply_(model, kv_cache=...) or "
                             "geoscale_fx.wrap(model, kv_cache=...)")
        return self

    def replace(self, **changes) -> "GeoscaleOptions":
        return replace(self, **changes)

    @property
    def quantize(self) -> str:
        """What is cast to FP8: "qkv" under lowering="fp8_qkv", else "scores"."""
        return "qkv" if self.lowering == "fp8_qkv" else "scores"

    @property
    def kernel(self) -> str:
        """How a logit site is lowered: lowering itself, "auto" under lowering="fp8_qkv"."""
        return "auto" if self.lowering == "fp8_qkv" else self.lowering

    @property
    def recipe(self):
        """The scaling recipe these options spell (``geoscale_fx.options.recipes``); with
        ``quantize``, ``kernel``, ``audit``, ``compiler`` and ``kv_cache`` it rebuilds them:
        ``GeoscaleOptions.from_recipe(o.recipe, quantize=o.quantize, ...) == o``."""
        return recipe_of(self)

    @classmethod
    def from_recipe(cls, recipe, *, quantize: str = "scores", kernel: str = "auto",
                    audit: bool = False, compiler: str = "inductor",
                    kv_cache: Optional[str] = None) -> "GeoscaleOptions":
        """The options of ``recipe`` (a ``GeometryRecipe``, ``DelayedRecipe``,
        ``CurrentRecipe`` or ``NoScalingRecipe``) with what is not a strategy: quantize
        ("scores" | "qkv"), kernel ("auto" | "fused" | "explicit"), audit, compiler, kv_cache.
        A combination that cannot take effect is a ValueError naming the options."""
        return cls._from_recipe(recipe, quantize, kernel, audit, compiler, kv_cache,
                                (f"quantize={quantize!r}", f"kernel={kernel!r}"))

    @classmethod
    def _from_recipe(cls, recipe, quantize, kernel, audit, compiler, kv_cache, labels):
        if not isinstance(recipe, RECIPES):
            raise ValueError(f"recipe must be one of {[c.__name__ for c in RECIPES]}, "
                             f"got {recipe!r}")
        lowering = lowering_of(quantize, kernel)
        if not isinstance(audit, bool):
            raise ValueError(f"audit must be True or False, got {audit!r}")
        check_recipe_use(recipe, quantize, kernel, audit, *labels)
        return cls(**recipe.flat(), lowering=lowering, audit=audit, compiler=compiler,
                   kv_cache=kv_cache)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "GeoscaleOptions":
        """Options from keyword arguments, with a clear error for an unknown one.

        The flat keywords of ``GeoscaleOptions``, ``quantize=`` / ``kernel=`` for
        ``lowering=``, and ``recipe=`` for the strategy's keywords (then as
        ``from_recipe``). A recipe and a keyword it spells (alpha, eta, ...), or lowering and
        quantize / kernel, are a ValueError naming both."""
        known = {f.name for f in fields(cls)} | {"recipe", "quantize", "kernel"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown geoscale option(s) {unknown}; known: {sorted(known)}")
        split = sorted({"quantize", "kernel"} & set(kwargs))
        if "lowering" in kwargs and split:
            raise ValueError(f"lowering={kwargs['lowering']!r} and {split} choose the same "
                             "thing (lowering='fp8_qkv' is quantize='qkv', the others "
                             "kernel=...); set quantize= and kernel= only")
        if "recipe" not in kwargs:
            if split:
                kwargs["lowering"] = lowering_of(kwargs.pop("quantize", "scores"),
                                                 kwargs.pop("kernel", "auto"))
            return cls(**kwargs)
        recipe = kwargs.pop("recipe")
        clash = sorted(set(kwargs) & RECIPE_KEYWORDS)
        if clash:
            raise ValueError(f"recipe={type(recipe).__name__}(...) and {clash} set the same "
                             f"options; set {clash} in the recipe or leave recipe= out")
        labels = (f"quantize={kwargs.get('quantize', 'scores')!r}",
                  f"kernel={kwargs.get('kernel', 'auto')!r}")
        if "lowering" in kwargs:
            lowering = kwargs.pop("lowering")
            check_one_of("lowering", lowering, LOWERINGS)
            kwargs["quantize"] = "qkv" if lowering == "fp8_qkv" else "scores"
            kwargs["kernel"] = "auto" if lowering == "fp8_qkv" else lowering
            labels = (f"lowering={lowering!r}",) * 2
        return cls._from_recipe(recipe, kwargs.pop("quantize", "scores"),
                                kwargs.pop("kernel", "auto"), kwargs.pop("audit", False),
                                kwargs.pop("compiler", "inductor"), kwargs.pop("kv_cache", None),
                                labels)



def lowering_of(quantize: str, kernel: str) -> str:
    """The ``lowering`` of a (quantize, kernel) pair: "fp8_qkv" for quantize="qkv" (whose
    kernel, FlashAttention-3's FP8 attention or its emulation, is chosen per site: kernel
    "auto"), else the kernel."""
    check_one_of("quantize", quantize, QUANTIZE)
    check_one_of("kernel", kernel, KERNELS)
    if quantize == "qkv" and kernel != "auto":
        raise ValueError(f"quantize='qkv' runs FP8 attention on q, k, v (FlashAttention-3's "
                         f"kernel or its emulation, chosen per site); kernel={kernel!r} "
                         "chooses how quantized logits are lowered; use kernel='auto' with "
                         "quantize='qkv'")
    return "fp8_qkv" if quantize == "qkv" else kernel
