"""Per-step FP8 scale of one attention site: predicted from weights, or from observed maxima.

A scale here is always a **divisor** applied to the logits before the FP8 cast
(``S_fp8 = Q(S / scale)``); TransformerEngine's multiplier is called ``te_multiplier``.
A policy is a small object: its state (``specs``), the divisor before the logits exist
(``predict``, traceable), and what it learns once they do (``observe``, traceable). The one
place that picks the policy for a site is :func:`make_policy`.

* ``GeometryScaling``: ``scale = α · B / (η · R_max)`` with ``B = M(Σ_t bound_t)`` the site's
  bound (one estimator per term, ``geoscale_fx.numerics.estimators``; M the modifiers) and α from an
  ``AlphaPolicy`` (a constant, the paper's α_min of the *current* length, or auto-α);
* ``DelayedScaling`` (paper): ``max(history) / (R_max · 0.9)``, history of 16 maxima
  initialised to 1.0; (TransformerEngine): multiplier ``(R_max / amax) / 2^margin`` from a
  history of 1024 zeros, kept when amax is 0, inf or nan;
* ``CurrentScaling``: ``max|S_t| / R_max`` of this very step; ``NoScaling``: no FP8.
"""
from __future__ import annotations

import torch

from geoscale_fx.numerics import head_weights, logit_bounds
from geoscale_fx.core import bounds
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.numerics.distributed import per_layer_reduced, reduce_max
from geoscale_fx.numerics.estimators import Estimator, make_estimator
from geoscale_fx.core.fp8 import overflowed
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.state import StateSpec

__all__ = ["ScalingPolicy", "GeometryScaling", "DelayedScaling", "CurrentScaling",
           "NoScaling", "AlphaPolicy", "make_policy", "common_specs", "observe", "finish_step",
           "NON_FINITE_TAG"]

PAPER_DELAYED_ETA = 0.9
TE_MARGIN = 0

#: the message of the in-graph assertion on non-finite bounds (the runtime then names the
#: parameter on the host, see ``runtime.GraphRuntime.diagnose``)
NON_FINITE_TAG = "geoscale: non-finite weights"


def common_specs(n_scale: int) -> list[StateSpec]:
    """What every scaled site records (read by ``report``)."""
    return [StateSpec("steps", ()), StateSpec("cached_steps", ()), StateSpec("bound", (n_scale,)),
            StateSpec("scale", (n_scale,), 1.0), StateSpec("amax", (n_scale,)),
            StateSpec("max_scaled", (n_scale,)), StateSpec("max_scaled_ever", (n_scale,)),
            StateSpec("overflow_heads", (n_scale,)), StateSpec("overflow_steps", ())]


# --------------------------------------------------------------------------------------
# α
# --------------------------------------------------------------------------------------

class AlphaPolicy:
    """α of a geometry site: a constant, α_min of the current length ("theory"), or auto-α.

    State ``alpha`` is written by exactly one party: its spec (constants), the graph
    ("theory", each step), and for auto-α the graph during the burn-in (α0) while
    ``alpha_final`` is written once, when the burn-in ends (``runtime``).
    """

    def __init__(self, options: GeoscaleOptions, site: AttentionSite, n_scale: int,
                 n_heads_total: int):
        self.auto = options.alpha == "auto"
        self.policy = options.alpha0 if self.auto else options.alpha
        self.options, self.site, self.n_scale = options, site, n_scale
        self.n_heads_total = max(n_heads_total, 1)

    @property
    def theory(self) -> bool:
        return self.policy == "theory"

    def specs(self) -> list[StateSpec]:
        fill = 0.0 if self.theory else float(self.policy)
        specs = [StateSpec("alpha", (self.n_scale,), fill)]
        if self.auto:
            opt, n = self.options, self.n_scale
            specs += [StateSpec("ratios", (opt.calib_steps, n)), StateSpec("calib_count", ()),
                      StateSpec("calibrated", ()), StateSpec("alpha_emp", (n,)),
                      StateSpec("alpha_final", (n,))]
        return specs

    def value(self, state: dict, seq_len) -> torch.Tensor:
        """α for this step, float64 ``(n_scale,)``; ``seq_len`` may be symbolic."""
        alpha = state["alpha"]
        if self.theory:
            length = torch.ones((), dtype=torch.float64, device=alpha.device) * seq_len
            theory = bounds.alpha_min_traced(self.site.model_dim, self.site.head_dim,
                                             self.n_heads_total, length, self.options.delta)
            alpha.copy_(theory.expand(alpha.shape))
        alpha = alpha.double()
        if self.auto:
            alpha = torch.where(state["calibrated"] > 0, state["alpha_final"].double(), alpha)
        return alpha

    def record_slack(self, amax: torch.Tensor, state: dict) -> None:
        """Auto-α burn-in: store r_t = max|S| / B_max (B_max: the bound with α = 1)."""
        torch._assert_async(torch.isfinite(amax).all(),
                            f"geoscale: non-finite logits during auto-alpha calibration of "
                            f"attention site '{self.site.name}'")
        steps = self.options.calib_steps
        count = state["calib_count"]
        slot = count.long().clamp(max=steps - 1)
        ratio = amax.double() / state["bound"].double().clamp_min(1e-30)
        row = torch.nn.functional.one_hot(slot, steps).to(ratio.dtype)
        active = (state["calibrated"] == 0).to(ratio.dtype)
        ratios = state["ratios"]
        ratios.copy_(ratios + active * row[:, None] * (ratio[None, :] - ratios))
        count.add_(active.float())


# --------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------

class ScalingPolicy:
    """Base: no state of its own, divisor known only once S is computed."""
    observes = True          # needs max|S| every step (materializes the logits)
    estimators: tuple[Estimator, ...] = ()

    def __init__(self, site: AttentionSite, options: GeoscaleOptions, n_scale: int):
        self.site, self.options, self.n_scale = site, options, n_scale

    def specs(self) -> list[StateSpec]:
        return []

    def predict(self, weights: dict, state: dict, seq_len, reuse: bool = False
                ) -> torch.Tensor:
        return torch.ones(1, device=state["scale"].device)

    def divisor_after(self, amax: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
        """The divisor applied once ``max|S|`` (``(n_scale,)``) is known."""
        return predicted

    def learn(self, amax: torch.Tensor, state: dict) -> None:
        """Policy-specific bookkeeping after a step's logits were seen."""

    def cold_start(self, weights: dict, state: dict, generator=None) -> int:
        return 0

    def refresh(self, weights: dict, state: dict) -> None:
        """Host side, once per change of the weights (inference graphs, compiled as the
        ``reuse_weights`` variant only): keep in the state what the per-step program reads
        from the weights alone."""


class NoScaling(ScalingPolicy):
    observes = False


class CurrentScaling(ScalingPolicy):
    def divisor_after(self, amax, predicted):
        return (amax / bounds.fp8_max(self.options.fp8_format)).clamp_min(1e-30).float()


class DelayedScaling(ScalingPolicy):

    def specs(self):
        opt = self.options
        init = 1.0 if opt.delayed_recipe == "paper" else 0.0
        return [StateSpec("history", (opt.delayed_history_len,), init, warm=True),
                StateSpec("te_multiplier", (), 1.0)]

    def predict(self, weights, state, seq_len, reuse=False):
        if self.options.delayed_recipe == "paper":
            peak = state["history"].amax()
            return (peak / (bounds.fp8_max(self.options.fp8_format) * PAPER_DELAYED_ETA)
                    ).reshape(1).float()
        return (1.0 / state["te_multiplier"]).reshape(1).float()

    def learn(self, amax, state):
        history = state["history"]
        history.copy_(torch.cat([amax.amax().reshape(1), history[:-1]]))
        if self.options.delayed_recipe == "te":
            peak = history.amax()
            fresh = (bounds.fp8_max(self.options.fp8_format) / peak) / (2.0 ** TE_MARGIN)
            ok = torch.isfinite(peak) & (peak > 0)
            state["te_multiplier"].copy_(torch.where(ok, fresh, state["te_multiplier"]))


class GeometryScaling(ScalingPolicy):

    def __init__(self, site, options, n_scale, n_heads_total: int):
        super().__init__(site, options, n_scale)
        self.estimators = tuple(
            make_estimator(term, i, site.softmax_scale, granularity=options.granularity,
                           estimator=options.estimator, rope_bound=options.rope_bound,
                           power_iters=options.power_iters,
                           cold_start_iters=options.cold_start_iters)
            for i, term in enumerate(site.terms))
        self.alpha = AlphaPolicy(options, site, n_scale, n_heads_total)
        self.observes = options.audit

    def specs(self):
        return [s for e in self.estimators for s in e.specs()] + self.alpha.specs()

    def _term_weights(self, weights: dict) -> list:
        resolve = {k: v.detach() if isinstance(v, torch.Tensor) else v
                   for k, v in weights.items()}.__getitem__
        return [head_weights.term_head_weights(t, resolve) for t in self.site.terms]

    def predict(self, weights, state, seq_len, reuse: bool = False):
        if reuse:   # the weights' part kept by the last refresh: nothing recomputed from them
            values = {k: v.detach() if isinstance(v, torch.Tensor) else v
                      for k, v in weights.items()}
            total = sum(e.reuse(values, state) for e in self.estimators)
        else:
            hws = self._term_weights(weights)
            total = sum(e.full_step(hw, state) for e, hw in zip(self.estimators, hws))
        bound = logit_bounds.apply_modifiers(total, self.site.modifiers,
                                             lambda name: weights[name].detach())
        torch._assert_async(torch.isfinite(bound).all(), self._non_finite_message())
        if per_layer_reduced(self.site, self.n_scale):   # one scale for heads on many ranks
            bound = reduce_max(bound, self.site.shard)
        state["bound"].copy_(bounds.round_up_f32(bound))
        alpha = self.alpha.value(state, seq_len)
        # a float32 divisor never below the float64 one: S/scale stays within η·R_max
        return bounds.round_up_f32(bounds.scale_factor(alpha * bound, eta=self.options.eta,
                                                       fmt=self.options.fp8_format))

    def _non_finite_message(self) -> str:
        if self.site.bound_by == "measured":   # the bound reads activations, not weights
            return (f"geoscale: non-finite q or k at attention site '{self.site.name}' (its "
                    "bound is measured from them: the activations reaching it are not finite)")
        return (f"{NON_FINITE_TAG} in attention site '{self.site.name}' "
                f"(parameters {', '.join(self.site.param_names)})")

    def learn(self, amax, state):
        if self.alpha.auto:
            self.alpha.record_slack(amax, state)

    def refresh(self, weights, state):
        with torch.no_grad():
            for estimator, hw in zip(self.estimators, self._term_weights(weights)):
                estimator.refresh(hw, state)

    def cold_start(self, weights, state, generator=None):
        with torch.no_grad():
            return sum(e.cold_start(hw, state, generator)
                       for e, hw in zip(self.estimators, self._term_weights(weights)))


def make_policy(site: AttentionSite, options: GeoscaleOptions, n_scale: int,
                n_heads_total: int) -> ScalingPolicy:
    """The scaling policy of a site for these options (the only place this is decided)."""
    if options.scaling == "geometry":
        return GeometryScaling(site, options, n_scale, n_heads_total)
    if options.scaling == "delayed":
        return DelayedScaling(site, options, n_scale)
    if options.scaling == "current":
        return CurrentScaling(site, options, n_scale)
    return NoScaling(site, options, n_scale)


# --------------------------------------------------------------------------------------
# Per step, shared by every lowering
# --------------------------------------------------------------------------------------

def observe(policy: ScalingPolicy, amax: torch.Tensor, divisor: torch.Tensor,
            state: dict) -> None:
    """Record this step's ``max|S|`` (``(n_scale,)``) and what the scale made of it."""
    amax = amax.float()
    scaled = amax / divisor
    state["scale"].copy_(divisor.expand_as(state["scale"]))   # current: known only now
    state["amax"].copy_(amax)
    state["max_scaled"].copy_(scaled)
    state["max_scaled_ever"].copy_(torch.maximum(state["max_scaled_ever"], scaled))
    over = overflowed(scaled, policy.options.fp8_format)
    state["overflow_heads"].add_(over.float())
    state["overflow_steps"].add_(over.any().float())
    policy.learn(amax, state)


def finish_step(state: dict, cached_keys: bool = False) -> None:
    """Count the step (``cached_steps``: the keys read a KV cache, i.e. a decode step)."""
    state["steps"].add_(1.0)
    if cached_keys:
        state["cached_steps"].add_(1.0)
