"""Planning: the one place that decides whether and how an analysed site is rewritten.

``plan_site`` consumes an ``AttentionSite`` (analysis) and the graph's context and returns a
``SitePlan`` (lowering, scaling policy, state layout, the graph nodes the program reads) or a
``Skip`` with the reason. Nothing downstream re-reads the graph to change its mind: the
rewrite consumes plans, the runtime consumes plans and state.

Lowerings:

* ``"fused"``: SDPA replaced by flex_attention whose ``score_mod`` quantizes ``S / scale``
  (O(L) memory; needs a divisor before S exists and no observation of max|S|);
* ``"explicit"``: SDPA replaced by a materialized attention (audits, delayed/current scaling,
  auto-α burn-in, CPU training, dropout);
* ``"inplace"``: the model's own explicit attention keeps its mask, softmax and ``· V``; the
  softmax's input (``logits`` role: the scores, or the softcap's output) is quantized;
* ``"fp8_qkv"`` (only when asked for: ``lowering="fp8_qkv"``): SDPA replaced by attention on
  FP8 q, k, v with descales predicted from the weights (``geoscale_fx.planning.qkv_scaling``) —
  FlashAttention-3's FP8 kernel (``qkv_kernel="fa3"``) or its emulation (``"emulated"``).
  A site whose q, k or v bound cannot be derived keeps a logit lowering, and the plan says
  why (``qkv_fallback``). At a site reading a KV cache (decode) q is bounded from the weights
  and k, v from the cache (its FP8 storage scale, or the values it holds:
  ``geoscale_fx.planning.qkv_scaling``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.kernels.logit_attention import inductor_cpu_fused_unsupported
from geoscale_fx.kernels.qkv_attention import fa3_available
from geoscale_fx.planning.qkv_scaling import OperandScaling
from geoscale_fx.planning.scaling import ScalingPolicy, common_specs, make_policy
from geoscale_fx.sites.model import AttentionSite, is_certified
from geoscale_fx.sites.state import StateSpec

__all__ = ["SitePlan", "Skip", "GraphContext", "plan_site", "runnable", "burn_in_variant",
           "reuse_variant", "qkv_fallback_reason"]


@dataclass(frozen=True)
class GraphContext:
    """What planning needs to know about the graph a site lives in."""
    device: str = "cpu"
    training: bool = False        # parameters require grad and grad mode is on
    symbolic: bool = False        # Dynamo gave the graph dynamic shapes
    n_heads_total: int = 0        # N of alpha="theory": query heads over all sites seen


@dataclass(frozen=True)
class Skip:
    """A site left as is, and why (shown by ``report`` and logged)."""
    site: AttentionSite
    reason: str


@dataclass(frozen=True)
class SitePlan:
    """Everything static about one rewritten site."""
    site: AttentionSite
    options: GeoscaleOptions
    key: str
    lowering: str                   # "fused" | "explicit" | "inplace" | "fp8_qkv"
    policy: ScalingPolicy
    n_scale: int                    # one scale per query head, or one per layer
    lowering_reason: str = ""       # why not fused (SDPA sites)
    calibrating: bool = False       # auto-α burn-in variant: observe S, record slack
    #: the inference form: the bound's weight part is read from the state, which the runtime
    #: refreshes on the host whenever the weights change (``ScalingPolicy.refresh``)
    reuse_weights: bool = False
    qkv_kernel: str = ""            # fp8_qkv: "fa3" (the CUDA kernel) or "emulated"
    #: lowering="fp8_qkv" was asked for but this site keeps a logit lowering: why
    qkv_fallback: str = ""

    @property
    def weight_names(self) -> tuple[str, ...]:
        """Graph nodes whose values the program receives (weights, biases, gains)."""
        if self.lowering == "fp8_qkv":   # a cache's k and v are read, not bounded from weights
            return self.site.parameter_nodes if self.site.cached_keys else \
                self.site.operand_nodes
        return self.site.weight_nodes if self.policy.estimators else ()

    @property
    def observes(self) -> bool:
        """The program computes max|S| (materialized logits) this step."""
        return self.policy.observes or self.calibrating

    @property
    def quantizes(self) -> bool:
        return self.options.scaling != "none"

    @property
    def certified(self) -> bool:
        """A proof, when the exact route runs: ``is_certified(site, options, lowering)``."""
        return is_certified(self.site, self.options, self.lowering)

    def state_specs(self) -> list[StateSpec]:
        if self.lowering == "fp8_qkv":
            return self.policy.specs()
        return common_specs(self.n_scale) + self.policy.specs()

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state buffers this plan's program takes, in order."""
        return tuple(s.name for s in self.state_specs())


def _n_scale(site: AttentionSite, options: GeoscaleOptions) -> int:
    per_head = options.scaling == "geometry" and options.granularity == "head"
    return site.n_q_heads if per_head else 1


def _sdpa_lowering(site: AttentionSite, options: GeoscaleOptions, policy: ScalingPolicy,
                   ctx: GraphContext) -> tuple[str, str]:
    reasons = []
    if options.lowering == "explicit":
        reasons.append("lowering='explicit'")
    if policy.observes:
        reasons.append("audit / delayed / current scaling observe max|S|")
    if ctx.training and ctx.device == "cpu":
        reasons.append("flex_attention has no backward on CPU")
    if ctx.device == "cpu" and options.compiler == "inductor" and ctx.symbolic:
        reasons.append("Inductor's CPU flex_attention template fails on graphs with symbolic "
                       "shapes (a dynamic recompile)")
    if ctx.device == "cpu" and options.compiler == "inductor" and not reasons:
        unsupported = inductor_cpu_fused_unsupported()
        if unsupported:
            reasons.append(unsupported)
    if site.dropout_p > 0:
        reasons.append("attention dropout")
    if options.lowering == "auto" and options.compiler != "inductor":
        # flex_attention fuses only under Inductor; elsewhere it runs its unfused reference
        # (and re-traces its score_mod with Dynamo at every trace): explicit costs less
        reasons.append(f"compiler={options.compiler!r} does not fuse flex_attention")
    if options.lowering == "auto" and not ctx.symbolic and site.q_len == 1:
        # a decode step: S is 1×L', as cheap to materialize as to stream, and the fused
        # kernel would rebuild its block mask (two sorts) every call
        reasons.append("one query (a decode step): S is 1×L'")
    return ("explicit", "; ".join(reasons)) if reasons else ("fused", "")


def qkv_fallback_reason(site: AttentionSite) -> str:
    """Why FP8 q/k/v cannot be applied to a supported site ("" when it can)."""
    if site.kind != "sdpa":
        return (f"{site.kind} attention ({site.node}): fp8_qkv replaces SDPA calls; the "
                "model's own attention keeps the in-place logit lowering")
    if site.bound_by == "measured":
        return ("its q and k are bounded by their norms measured at every call (the weights "
                "cannot bound them), and fp8_qkv needs descales predicted from the weights")
    if site.value is None and not site.cached_keys:   # cached values: OperandScaling.reads
        return f"the values could not be traced to their projection ({site.value_reason})"
    others = sorted({m.kind for m in site.modifiers if not m.fp8_qkv})
    if others:
        return f"score modifiers {others} before the softmax"
    return ""


def _qkv_kernel(site: AttentionSite, options: GeoscaleOptions,
                ctx: GraphContext) -> tuple[str, str]:
    """``("fa3" | "emulated", why not the kernel)``."""
    reasons = []
    if not fa3_available(ctx.device):
        reasons.append("no CUDA device with torch's FP8 FlashAttention-3 activated")
    if ctx.training:
        reasons.append("the FP8 kernel has no backward")
    if options.fp8_format != "e4m3":
        reasons.append("the FP8 kernel takes e4m3 only")
    if site.has_mask or site.dropout_p > 0:
        reasons.append("the FP8 kernel takes no mask and no dropout")
    return ("emulated", "; ".join(reasons)) if reasons else ("fa3", "")


def runnable(site: AttentionSite) -> AttentionSite:
    """The site a plan runs: one the weights cannot bound, bounded by its measured q and k
    (``site.measured``) when that applies; ``site`` itself otherwise."""
    return site.measured if not site.supported and site.measured is not None else site


def plan_site(site: AttentionSite, options: GeoscaleOptions, key: str,
              ctx: GraphContext) -> SitePlan | Skip:
    """A plan for ``site``, or why it is left as is (a site the weights cannot bound runs
    bounded by its measured q and k when it can: ``runnable``)."""
    site = runnable(site)
    if not site.supported:
        return Skip(site, site.reason)
    if site.kind in ("mha", "encoder_layer"):
        return Skip(site, f"{site.kind}: an opaque fused op ({site.node}); analysed, "
                          "not rewritten")
    fallback = ""
    if options.lowering == "fp8_qkv":
        fallback = qkv_fallback_reason(site)
        if not fallback:
            kernel, why = _qkv_kernel(site, options, ctx)
            return SitePlan(site=site, options=options, key=key, lowering="fp8_qkv",
                            policy=OperandScaling(site, options), n_scale=site.n_kv_heads,
                            lowering_reason=why, qkv_kernel=kernel)
    n_scale = _n_scale(site, options)
    policy = make_policy(site, options, n_scale, ctx.n_heads_total)
    if site.kind == "explicit":
        lowering, why = "inplace", ""
    else:
        lowering, why = _sdpa_lowering(site, options, policy, ctx)
    return SitePlan(site=site, options=options, key=key, lowering=lowering, policy=policy,
                    n_scale=n_scale, lowering_reason=why, qkv_fallback=fallback)


def reuse_variant(plan: SitePlan) -> SitePlan:
    """The inference form of a plan: the weights' part of the bound read from the state."""
    return replace(plan, reuse_weights=True)


def burn_in_variant(plan: SitePlan) -> SitePlan:
    """The auto-α burn-in form of a plan: observe max|S| (explicit lowering), record slack."""
    lowering = "inplace" if plan.lowering == "inplace" else "explicit"
    return replace(plan, calibrating=True, lowering=lowering)
