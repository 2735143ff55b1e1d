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
  softmax's input (``logits`` role: the scores, or the softcap's output) is quantized.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from geoscale_fx.config import GeoscaleOptions
from geoscale_fx.passes.site_model import AttentionSite
from geoscale_fx.scaling import ScalingPolicy, common_specs, make_policy
from geoscale_fx.state import StateSpec

__all__ = ["SitePlan", "Skip", "GraphContext", "plan_site", "burn_in_variant", "reuse_variant"]


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
    lowering: str                   # "fused" | "explicit" | "inplace"
    policy: ScalingPolicy
    n_scale: int                    # one scale per query head, or one per layer
    lowering_reason: str = ""       # why not fused (SDPA sites)
    calibrating: bool = False       # auto-α burn-in variant: observe S, record slack
    #: the variant for calls whose weights did not change since the last full step (decode,
    #: inference): the bound's weight part is read from the state, not recomputed
    reuse_weights: bool = False

    @property
    def weight_names(self) -> tuple[str, ...]:
        """Graph nodes whose values the program receives (weights, biases, gains)."""
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
        """A proof, when the exact route ran and α ≥ 1: per head, every term certified."""
        opt = self.options
        assumed = self.site.rope and opt.rope_bound == "interaction"   # the paper's, for RoPE
        return (self.site.certified and not assumed and opt.scaling == "geometry"
                and opt.granularity == "head" and isinstance(opt.alpha, (int, float))
                and opt.alpha >= 1.0)

    def state_specs(self) -> list[StateSpec]:
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
    if site.dropout_p > 0:
        reasons.append("attention dropout")
    return ("explicit", "; ".join(reasons)) if reasons else ("fused", "")


def plan_site(site: AttentionSite, options: GeoscaleOptions, key: str,
              ctx: GraphContext) -> SitePlan | Skip:
    """A plan for ``site``, or why it is left as is."""
    if not site.supported:
        return Skip(site, site.reason)
    if site.kind in ("mha", "encoder_layer"):
        return Skip(site, f"{site.kind}: an opaque fused op ({site.node}); analysed, "
                          "not rewritten")
    n_scale = _n_scale(site, options)
    policy = make_policy(site, options, n_scale, ctx.n_heads_total)
    if site.kind == "explicit":
        lowering, why = "inplace", ""
    else:
        lowering, why = _sdpa_lowering(site, options, policy, ctx)
    return SitePlan(site=site, options=options, key=key, lowering=lowering, policy=policy,
                    n_scale=n_scale, lowering_reason=why)


def reuse_variant(plan: SitePlan) -> SitePlan:
    """The form of a plan for a step whose weights are those of the previous full step."""
    return replace(plan, reuse_weights=True)


def burn_in_variant(plan: SitePlan) -> SitePlan:
    """The auto-α burn-in form of a plan: observe max|S| (explicit lowering), record slack."""
    lowering = "inplace" if plan.lowering == "inplace" else "explicit"
    return replace(plan, calibrating=True, lowering=lowering)
