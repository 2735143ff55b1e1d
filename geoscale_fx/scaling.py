"""Per-step FP8 scale of one attention site: predicted from weights, or from observed maxima.

``SitePlan`` is the static description the compiled graph closes over; the functions take the
site's parameter tensors and state tensors (graph inputs) and return the *divisor* applied to
the logits before the FP8 cast, updating state in place. All of it is traceable.

* geometry: ``scale = α · bound / (η · R_max)`` where ``bound`` is the site's certified bound on
  ``|S|`` (``heads.site_logit_bound``) with σ from the chosen estimator;
* delayed (paper): ``scale_t = max(history) / (R_max · 0.9)``, history of 16 maxima, initialised
  to 1.0; delayed (TransformerEngine): multiplier ``(R_max / amax) / 2^margin`` from a history of
  1024 (zeros), kept when amax is 0, inf or nan;
* current: ``max|S_t| / R_max`` of this very step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from geoscale_fx import bounds, heads, spectral
from geoscale_fx.config import GeoscaleOptions
from geoscale_fx.fp8 import overflowed
from geoscale_fx.passes.site_model import AttentionSite
from geoscale_fx.state import StateSpec

__all__ = ["SitePlan", "state_specs", "predict_divisor", "observe", "cold_start",
           "finalize_calibration"]

PAPER_DELAYED_ETA = 0.9
TE_MARGIN = 0


@dataclass(frozen=True)
class SitePlan:
    """Everything static about one rewritten site."""
    site: AttentionSite
    options: GeoscaleOptions
    key: str
    lowering: str                   # "fused" | "explicit" | "inplace"
    weight_names: tuple[str, ...]   # graph nodes whose values the program receives
    alpha: float                    # initial α (constant policies; α0 for auto)
    n_heads_total: int              # N of alpha="theory"
    calibrating: bool = False       # auto-α burn-in: observe S and record slack ratios

    @property
    def n_scale(self) -> int:
        """How many scales: one per query head, or one per layer."""
        per_head = self.options.scaling == "geometry" and self.options.granularity == "head"
        return self.site.n_q_heads if per_head else 1

    @property
    def power(self) -> bool:
        return self.options.scaling == "geometry" and self.options.estimator == "power"

    @property
    def norm_product(self) -> bool:
        return self.site.rope and self.options.rope_bound == "norm_product"

    @property
    def params_message(self) -> str:
        names = sorted({n for p in (self.site.q, self.site.k)
                        for n in (p.weight_param, p.bias_param) if n})
        return ", ".join(names)


def state_specs(plan: SitePlan) -> list[StateSpec]:
    site, opt, n = plan.site, plan.options, plan.n_scale
    specs = [StateSpec("steps", ()), StateSpec("alpha", (n,), plan.alpha),
             StateSpec("sigma", (n,)), StateSpec("bound", (n,)), StateSpec("scale", (n,), 1.0),
             StateSpec("amax", (n,)), StateSpec("max_scaled", (n,)),
             StateSpec("max_scaled_ever", (n,)), StateSpec("overflow_heads", (n,)),
             StateSpec("overflow_steps", ())]
    if opt.scaling == "geometry":
        n_vec = site.n_q_heads if opt.granularity == "head" else 1
        if plan.power and plan.norm_product and opt.granularity == "head":
            specs += [StateSpec("w_q", (site.n_q_heads, site.head_dim), warm=True),
                      StateSpec("w_k", (site.n_kv_heads, site.head_dim), warm=True),
                      StateSpec("floor_q", (site.n_q_heads,)),
                      StateSpec("floor_k", (site.n_kv_heads,))]
        elif plan.power:
            specs += [StateSpec("u", (n_vec, site.q.model_dim), warm=True),
                      StateSpec("v", (n_vec, site.k.model_dim), warm=True),
                      StateSpec("floor", (n_vec,))]
    elif opt.scaling == "delayed":
        length = opt.delayed_history_len
        init = 1.0 if opt.delayed_recipe == "paper" else 0.0
        specs += [StateSpec("history", (length,), init, warm=True),
                  StateSpec("te_scale", (), 1.0)]
    if opt.alpha == "auto":
        specs += [StateSpec("ratios", (opt.calib_steps, n)), StateSpec("calib_count", ()),
                  StateSpec("calibrated", ()), StateSpec("alpha_emp", (n,)),
                  StateSpec("alpha_final", (n,))]
    return specs


# --------------------------------------------------------------------------------------
# Geometry: predicted before the forward pass
# --------------------------------------------------------------------------------------

def _detached(weights: dict) -> dict:
    return {k: v.detach() for k, v in weights.items()}


def _per_head_bound(plan: SitePlan, hw, state: dict) -> torch.Tensor:
    site = plan.site
    if plan.norm_product:
        if plan.power:
            iters = plan.options.power_iters
            nq = spectral.head_norm_power_step(hw.a_q, state["w_q"], iters).double()
            nk = spectral.head_norm_power_step(hw.a_k, state["w_k"], iters).double()
            nq = torch.maximum(nq, state["floor_q"].double())
            nk = torch.maximum(nk, state["floor_k"].double())
            state["floor_q"].zero_()
            state["floor_k"].zero_()
        else:
            nq, nk = spectral.head_spectral_norms(hw.a_q), spectral.head_spectral_norms(hw.a_k)
        # the norm this bound uses: ‖A_q,h‖‖A_k,g(h)‖ (≥ σ_h), reported as "sigma"
        state["sigma"].copy_(nq * nk.repeat_interleave(nq.shape[0] // nk.shape[0]))
        return heads.norm_product_bound(site, hw, nq, nk)
    if plan.power:
        sigma = spectral.per_head_power_step(hw.a_q, hw.a_k, state["u"], state["v"],
                                             plan.options.power_iters).double()
        sigma = torch.maximum(sigma, state["floor"].double())
        state["floor"].zero_()
    else:
        sigma = spectral.per_head_sigma_exact(hw.a_q, hw.a_k)
    state["sigma"].copy_(sigma)
    return heads.site_logit_bound(site, hw, rope_bound="interaction", sigma=sigma)


def _per_layer_bound(plan: SitePlan, hw, state: dict) -> torch.Tensor:
    site = plan.site
    if plan.power:
        sigma = spectral.per_layer_power_step(hw.a_q, hw.a_k, state["u"], state["v"],
                                              plan.options.power_iters).double()
        sigma = torch.maximum(sigma.reshape(1), state["floor"].double())
        state["floor"].zero_()
    else:
        sigma = spectral.per_layer_sigma_exact(hw.a_q, hw.a_k).reshape(1)
    state["sigma"].copy_(sigma)
    terms = heads.site_bound_terms(site, hw, sigma=sigma)
    offsets = (site.q.radius * terms["aq_ck"] + site.k.radius * terms["ak_cq"]
               + terms["cq_ck"].abs()).amax().reshape(1)
    bound = abs(site.softmax_scale) * (site.q.radius * site.k.radius * sigma + offsets)
    return bound * heads.rotation_gain(site) if site.rope else bound


def predict_divisor(plan: SitePlan, weights: dict, state: dict) -> torch.Tensor:
    """The divisor for this step's logits, ``(n_scale,)`` float32, computed before S exists."""
    opt = plan.options
    if opt.scaling == "geometry":
        hw = heads.site_head_weights(plan.site, _detached(weights).__getitem__)
        bound = (_per_head_bound(plan, hw, state) if opt.granularity == "head"
                 else _per_layer_bound(plan, hw, state))
        torch._assert_async(torch.isfinite(bound).all(),
                            f"geoscale: non-finite weights in attention site "
                            f"'{plan.site.name}' (parameters {plan.params_message})")
        state["bound"].copy_(bound)
        alpha = state["alpha"].double()
        if opt.alpha == "auto":
            alpha = torch.where(state["calibrated"] > 0, state["alpha_final"].double(), alpha)
        divisor = bounds.scale_factor(alpha * bound, eta=opt.eta, fmt=opt.fp8_format)
    elif opt.scaling == "delayed" and opt.delayed_recipe == "paper":
        divisor = (state["history"].amax() / (bounds.fp8_max(opt.fp8_format)
                                                * PAPER_DELAYED_ETA)).reshape(1)
    elif opt.scaling == "delayed":
        divisor = (1.0 / state["te_scale"]).reshape(1)
    else:  # current / none: known only once S is computed
        divisor = torch.ones(1, device=state["scale"].device)
    divisor = divisor.float()
    state["scale"].copy_(divisor.expand_as(state["scale"]))
    return divisor


# --------------------------------------------------------------------------------------
# Observed: once the logits exist (explicit lowering, audits, baselines)
# --------------------------------------------------------------------------------------

def current_divisor(plan: SitePlan, amax: torch.Tensor) -> torch.Tensor:
    """Current scaling: this step's ``max|S| / R_max`` (floored away from zero)."""
    return (amax / bounds.fp8_max(plan.options.fp8_format)).clamp_min(1e-30).float()


def observe(plan: SitePlan, amax: torch.Tensor, divisor: torch.Tensor, state: dict) -> None:
    """Record this step's ``max|S|`` (``(n_scale,)``) and what the scale made of it."""
    opt = plan.options
    fmt_max = bounds.fp8_max(opt.fp8_format)
    amax = amax.float()
    scaled = amax / divisor
    state["scale"].copy_(divisor.expand_as(state["scale"]))   # current: known only now
    state["amax"].copy_(amax)
    state["max_scaled"].copy_(scaled)
    state["max_scaled_ever"].copy_(torch.maximum(state["max_scaled_ever"], scaled))
    over = overflowed(scaled, opt.fp8_format)
    state["overflow_heads"].add_(over.float())
    state["overflow_steps"].add_(over.any().float())
    if opt.scaling == "delayed":
        layer_amax = amax.amax().reshape(1)
        history = state["history"]
        history.copy_(torch.cat([layer_amax, history[:-1]]))
        if opt.delayed_recipe == "te":
            peak = history.amax()
            fresh = (fmt_max / peak) / (2.0 ** TE_MARGIN)
            ok = torch.isfinite(peak) & (peak > 0)
            state["te_scale"].copy_(torch.where(ok, fresh, state["te_scale"]))
    if plan.calibrating:
        _record_slack(plan, amax, state)


def _record_slack(plan: SitePlan, amax: torch.Tensor, state: dict) -> None:
    """Auto-α burn-in: store r_t = max|S| / B_max (B_max: the bound with α = 1)."""
    torch._assert_async(torch.isfinite(amax).all(),
                        f"geoscale: non-finite logits during auto-alpha calibration of "
                        f"attention site '{plan.site.name}'")
    count = state["calib_count"]
    slot = count.long().clamp(max=plan.options.calib_steps - 1)
    ratio = amax.double() / state["bound"].double().clamp_min(1e-30)
    row = torch.nn.functional.one_hot(slot, plan.options.calib_steps).to(ratio.dtype)
    active = (state["calibrated"] == 0).to(ratio.dtype)
    state["ratios"].copy_(state["ratios"] + active * row[:, None] * (ratio[None, :]
                                                                     - state["ratios"]))
    count.add_(active.float())


def finish_step(state: dict) -> None:
    state["steps"].add_(1.0)


# --------------------------------------------------------------------------------------
# Cold start (host side, eager): certified values and warm vectors from the weights
# --------------------------------------------------------------------------------------

_COLD_TOLERANCE = 1e-4
_COLD_MAX_ITERS = 1000


def _converge(step, exact: torch.Tensor, minimum: int) -> int:
    """Run ``step()`` (one power iteration, returns estimates) at least ``minimum`` times and
    until every estimate is within ``_COLD_TOLERANCE`` of the known exact value."""
    for i in range(1, _COLD_MAX_ITERS + 1):
        estimate = step().double()
        if i >= minimum and bool((estimate >= exact * (1 - _COLD_TOLERANCE)).all()):
            return i
    return _COLD_MAX_ITERS


def cold_start(plan: SitePlan, weights: dict, state: dict,
               generator: torch.Generator | None = None) -> int:
    """Certified values into the floors and converged power vectors into the state.

    The exact route gives σ (or ‖A‖ for RoPE sites); the vectors are iterated from random at
    least ``cold_start_iters`` times (the paper's 5) and until they reproduce it, so the warm
    steps that follow start from the right singular vectors even when σ1 ≈ σ2. Returns the
    number of iterations used.
    """
    if plan.options.scaling != "geometry" or not plan.power:
        return 0
    minimum = plan.options.cold_start_iters
    with torch.no_grad():
        hw = heads.site_head_weights(plan.site, _detached(weights).__getitem__)
        if "w_q" in state:
            used = 0
            for name, a, floor in (("w_q", hw.a_q, "floor_q"), ("w_k", hw.a_k, "floor_k")):
                w = torch.randn(state[name].shape, generator=generator)
                state[name].copy_(torch.nn.functional.normalize(w, dim=-1))
                exact = spectral.head_spectral_norms(a)
                used += _converge(lambda: spectral.head_norm_power_step(a, state[name]),
                                  exact, minimum)
                state[floor].copy_(exact)
            return used
        u, v = spectral.init_power_state(state["u"].shape[0], state["u"].shape[1],
                                         state["v"].shape[1], generator=generator)
        state["u"].copy_(u)
        state["v"].copy_(v)
        if plan.options.granularity == "head":
            exact = spectral.per_head_sigma_exact(hw.a_q, hw.a_k)
            step = spectral.per_head_power_step
        else:
            exact = spectral.per_layer_sigma_exact(hw.a_q, hw.a_k).reshape(1)
            step = spectral.per_layer_power_step
        used = _converge(lambda: step(hw.a_q, hw.a_k, state["u"], state["v"]).reshape(-1),
                         exact, minimum)
        state["floor"].copy_(exact)
        return used


# --------------------------------------------------------------------------------------
# Auto-α: freeze α_final = quantile_q({r_t}) · κ (host side, once)
# --------------------------------------------------------------------------------------

def finalize_calibration(plan: SitePlan, state: dict) -> torch.Tensor:
    """Freeze ``α_final = quantile_q(r) · κ`` per scale from the recorded slack ratios.

    Raises ValueError when nothing was recorded or a ratio is not finite (a NaN α would
    silently disable the scale). Returns α_final.
    """
    count = int(state["calib_count"].item())
    ratios = state["ratios"][:count].double()
    if count == 0:
        raise ValueError(f"geoscale: auto-alpha calibration of attention site "
                         f"'{plan.site.name}' recorded no slack ratio")
    if not bool(torch.isfinite(ratios).all()):
        raise ValueError(f"geoscale: auto-alpha calibration of attention site "
                         f"'{plan.site.name}' saw a non-finite logit; α would be NaN")
    alpha_emp = torch.quantile(ratios, plan.options.quantile, dim=0)
    alpha_final = alpha_emp * plan.options.kappa
    with torch.no_grad():
        state["alpha_emp"].copy_(alpha_emp)
        state["alpha_final"].copy_(alpha_final)
        state["calibrated"].fill_(1.0)
    return alpha_final
