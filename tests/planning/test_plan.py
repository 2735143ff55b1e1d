"""Planning: skip reasons, lowering choice, scale granularity, certification, state layout."""
from __future__ import annotations

import pytest

from geoscale_fx.analysis.modifiers.mask import Mask
from geoscale_fx.analysis.modifiers.position_bias import PositionBias
from geoscale_fx.analysis.modifiers.sink import Sink
from geoscale_fx.analysis.modifiers.softcap import Softcap
from geoscale_fx.kernels import logit_attention
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.planning import plan as plan_module
from geoscale_fx.planning.plan import GraphContext, SitePlan, Skip, burn_in_variant, plan_site
from geoscale_fx.planning.scaling import CurrentScaling, DelayedScaling, GeometryScaling, NoScaling
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.terms import Rotary, Side, Source, Term

D, DH, NQ, NKV = 24, 6, 4, 2
CPU = GraphContext(device="cpu", training=False, symbolic=False)


def _side(n_heads: int, offset: int = 0, rotary=None, width: int = D, weight: str = "w",
          bias=None) -> Side:
    features = tuple(tuple(range(offset + h * DH, offset + (h + 1) * DH)) for h in range(n_heads))
    return Side(Source("rmsnorm", "norm", width, channel_ops=(("mul", "gain"),)), weight,
                "dense", features, bias=bias, rotary=rotary)


def _term(rope: bool = False, width: int = D, weight: str = "w") -> Term:
    rot = Rotary("rotate_half", 1.0, True, tuple((j + DH // 2) % DH for j in range(DH)),
                 "cos", "sin") if rope else None
    return Term(_side(NQ, 0, rot, width, weight, bias="b"),
                _side(NKV, NQ * DH, rot, width, weight, bias="b"))


def _site(terms=None, **kw) -> AttentionSite:
    fields = dict(name="attn", index=0, kind="sdpa", node="sdpa", supported=True,
                  n_q_heads=NQ, n_kv_heads=NKV, head_dim=DH, softmax_scale=DH ** -0.5,
                  score_scale=DH ** -0.5, terms=tuple(terms or (_term(),)))
    fields.update(kw)
    return AttentionSite(**fields)


def _plan(site=None, ctx=CPU, **options) -> SitePlan | Skip:
    return plan_site(site or _site(), GeoscaleOptions(**options), "attn", ctx)


# the plans below are those of a CPU whose Inductor runs the flex_attention template; where
# it does not: test_a_cpu_inductor_cannot_fuse_on_is_explicit
pytestmark = pytest.mark.usefixtures("a_cpu_inductor_fuses_on")


# --------------------------------------------------------------------------------------
# Skips
# --------------------------------------------------------------------------------------

def test_unsupported_site_is_skipped_with_its_own_reason():
    """An unsupported site is a Skip carrying the analysis' reason verbatim."""
    site = _site(supported=False, reason="`sdpa`: the query is not a projection", terms=())
    result = _plan(site)
    assert isinstance(result, Skip)
    assert result.site is site
    assert result.reason == "`sdpa`: the query is not a projection"


@pytest.mark.parametrize("kind", ["mha", "encoder_layer"])
def test_opaque_fused_ops_are_analysed_but_skipped(kind):
    """nn.MultiheadAttention / the fused encoder layer are never rewritten."""
    result = _plan(_site(kind=kind, node="mha_op"))
    assert isinstance(result, Skip)
    assert "opaque" in result.reason and kind in result.reason and "mha_op" in result.reason


def test_explicit_site_with_baddbmm_scores_is_rewritten_in_place():
    """baddbmm's bias is a position bias: the rewrite splits the op and quantizes q·kᵀ."""
    result = _plan(_site(kind="explicit", node="softmax", score_op="baddbmm"))
    assert not isinstance(result, Skip) and result.lowering == "inplace"


# --------------------------------------------------------------------------------------
# Lowering
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"scaling": "delayed"}, {"audit": True},
                                     {"scaling": "none"}])
def test_explicit_site_is_rewritten_in_place(options):
    """The model's own attention keeps its softmax: lowering 'inplace', whatever the policy."""
    result = _plan(_site(kind="explicit", node="softmax", score_op="matmul"), **options)
    assert isinstance(result, SitePlan)
    assert result.lowering == "inplace" and result.lowering_reason == ""


@pytest.mark.parametrize("options", [{}, {"scaling": "none"}, {"estimator": "exact"},
                                     {"granularity": "layer"}, {"lowering": "fused"}])
def test_sdpa_inference_on_cpu_is_fused(options):
    """Predictive scaling (or none) in inference: the fused flex_attention lowering."""
    result = _plan(**options)
    assert isinstance(result, SitePlan)
    assert result.lowering == "fused" and result.lowering_reason == ""
    assert result.key == "attn" and not result.calibrating


@pytest.mark.parametrize("ctx, site_kw, options, reason", [
    (GraphContext(device="cpu", training=True), {}, {}, "no backward on CPU"),
    (GraphContext(device="cpu", symbolic=True), {}, {}, "symbolic shapes"),
    (CPU, {"dropout_p": 0.1}, {}, "dropout"),
    (CPU, {}, {"audit": True}, "observe max|S|"),
    (CPU, {}, {"scaling": "delayed"}, "observe max|S|"),
    (CPU, {}, {"scaling": "current"}, "observe max|S|"),
    (CPU, {}, {"lowering": "explicit"}, "lowering='explicit'"),
])
def test_sdpa_falls_back_to_explicit_with_the_reason(ctx, site_kw, options, reason):
    """Every case flex_attention cannot serve gives 'explicit' and says why."""
    result = _plan(_site(**site_kw), ctx, **options)
    assert isinstance(result, SitePlan)
    assert result.lowering == "explicit"
    assert reason in result.lowering_reason


@pytest.mark.parametrize("options", [{}, {"lowering": "fused"}])
def test_a_cpu_inductor_cannot_fuse_on_is_explicit(monkeypatch, options):
    """Where torch's own check refuses Inductor's CPU flex_attention template (simulated:
    ATEN_CPU_CAPABILITY=default, as a CPU without AVX2), the plan is explicit and says why,
    lowering='fused' included; with another compiler the check does not apply."""
    monkeypatch.setattr(plan_module, "inductor_cpu_fused_unsupported",
                        logit_attention.inductor_cpu_fused_unsupported)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    result = _plan(**options)
    assert result.lowering == "explicit"
    assert "flex_attention template does not run on this platform" in result.lowering_reason
    other = _plan(**options, compiler="aot_eager")
    assert "this platform" not in other.lowering_reason
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    if logit_attention.inductor_cpu_fused_unsupported() == "":    # this machine: AVX2
        assert _plan(**options).lowering == "fused"


@pytest.mark.parametrize("ctx", [GraphContext(device="cuda", training=True),
                                 GraphContext(device="cuda", symbolic=True)])
def test_training_and_symbolic_shapes_off_cpu_stay_fused(ctx):
    """The CPU-only limitations do not apply on other devices."""
    result = _plan(ctx=ctx)
    assert result.lowering == "fused" and result.lowering_reason == ""


def test_a_one_query_step_is_materialized_unless_fused_is_asked_for():
    """A decode step (one query, static shapes): S is 1×L', the explicit lowering, with the
    reason; lowering='fused' keeps the fused kernel, symbolic shapes keep the plan as is."""
    one = _site(q_len=1)
    result = _plan(one)
    assert result.lowering == "explicit" and "one query" in result.lowering_reason
    assert _plan(one, lowering="fused").lowering == "fused"
    assert _plan(one, GraphContext(device="cuda", symbolic=True)).lowering == "fused"
    assert _plan(_site(q_len=2)).lowering == "fused"


def test_symbolic_shapes_on_cpu_are_fused_without_inductor():
    """Only Inductor's CPU template fails on symbolic shapes: aot_eager keeps 'fused' when
    asked for."""
    ctx = GraphContext(device="cpu", symbolic=True)
    assert _plan(ctx=ctx, compiler="inductor").lowering == "explicit"
    result = _plan(ctx=ctx, compiler="aot_eager", lowering="fused")
    assert result.lowering == "fused" and result.lowering_reason == ""


@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])
def test_auto_lowers_explicitly_where_nothing_fuses_flex_attention(compiler):
    """flex_attention is fused by Inductor only; under another compiler 'auto' takes the
    explicit lowering, saying why, and 'fused' is still taken when asked for."""
    result = _plan(compiler=compiler)
    assert result.lowering == "explicit"
    assert result.lowering_reason == f"compiler={compiler!r} does not fuse flex_attention"
    assert _plan(compiler=compiler, lowering="fused").lowering == "fused"
    assert _plan(compiler="inductor").lowering == "fused"


def test_several_reasons_are_all_listed():
    """Every reason for the explicit lowering is reported, not only the first."""
    result = _plan(_site(dropout_p=0.2), GraphContext(device="cpu", training=True),
                   lowering="explicit")
    for part in ("lowering='explicit'", "no backward on CPU", "dropout"):
        assert part in result.lowering_reason
    assert result.lowering_reason.count(";") == 2


# --------------------------------------------------------------------------------------
# Policy, n_scale, certification
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, n_scale, policy", [
    ({}, NQ, GeometryScaling),
    ({"granularity": "head", "estimator": "exact"}, NQ, GeometryScaling),
    ({"granularity": "layer"}, 1, GeometryScaling),
    ({"scaling": "delayed"}, 1, DelayedScaling),
    ({"scaling": "current"}, 1, CurrentScaling),
    ({"scaling": "none"}, 1, NoScaling),
])
def test_n_scale_and_policy(options, n_scale, policy):
    """One scale per query head for geometry/head, one per layer otherwise."""
    result = _plan(**options)
    assert result.n_scale == n_scale
    assert type(result.policy) is policy
    assert result.policy.n_scale == n_scale
    specs = {s.name: s for s in result.state_specs()}
    assert specs["scale"].shape == (n_scale,) and specs["bound"].shape == (n_scale,)


def test_n_scale_follows_the_sites_query_heads():
    """Per head: n_scale is the site's own query head count."""
    assert _plan(_site(n_q_heads=8)).n_scale == 8


@pytest.mark.parametrize("site_kw, options, certified", [
    ({}, {}, True),
    ({}, {"estimator": "exact"}, True),
    ({}, {"alpha": 2.0}, True),
    ({}, {"alpha": 1}, True),
    ({}, {"granularity": "layer"}, False),
    ({}, {"alpha": 0.5}, False),
    ({}, {"alpha": "theory"}, False),
    ({}, {"alpha": "auto"}, False),
    ({}, {"scaling": "delayed"}, False),
    ({}, {"scaling": "none"}, False),
    ({"terms": (_term(rope=True),)}, {}, True),
    ({"terms": (_term(rope=True),), "rope_bound": "interaction"},
     {"rope_bound": "interaction"}, False),
    ({"terms": (_term(), _term(width=16, weight="w2"))}, {}, True),
    # the estimator follows the options: the paper's RoPE bound is never a proof
    ({"terms": (_term(rope=True),)}, {"rope_bound": "interaction"}, False),
])
def test_certified_only_for_geometry_per_head_with_alpha_at_least_one(site_kw, options,
                                                                      certified):
    """A proof needs geometry, per head, numeric α ≥ 1 and a certified site."""
    result = _plan(_site(**site_kw), **options)
    assert result.certified is certified


def test_uncertified_site_is_never_certified():
    """The site's own certification is required (RoPE under the interaction bound)."""
    site = _site(terms=(_term(rope=True),)).with_rope_bound("interaction")
    assert site.certified is False
    assert _plan(site).certified is False
    assert _plan(site.with_rope_bound("norm_product")).certified is True


# --------------------------------------------------------------------------------------
# State layout and weights
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"estimator": "exact"}, {"granularity": "layer"},
                                     {"alpha": "auto"}, {"alpha": "theory"},
                                     {"scaling": "delayed"}, {"scaling": "current"},
                                     {"scaling": "none"}, {"audit": True}])
def test_state_spec_names_are_unique_and_include_the_common_ones(options):
    """Every layout names steps/bound/scale once, and no name twice."""
    for site in (_site(), _site(terms=(_term(), _term(width=16, weight="w2"))),
                 _site(terms=(_term(rope=True),))):
        names = [s.name for s in _plan(site, **options).state_specs()]
        assert len(names) == len(set(names)), names
        assert {"steps", "bound", "scale"} <= set(names)


@pytest.mark.parametrize("estimator, per_term", [("exact", ("sigma",)),
                                                 ("power", ("sigma", "u", "v", "floor"))])
def test_two_term_site_has_state_for_both_terms(estimator, per_term):
    """Term 1's estimator state is prefixed 't1_' next to term 0's."""
    site = _site(terms=(_term(), _term(width=16, weight="w2")))
    specs = {s.name: s for s in _plan(site, estimator=estimator).state_specs()}
    for base in per_term:
        assert base in specs and f"t1_{base}" in specs
    if estimator == "power":
        assert specs["u"].shape == (NQ, D) and specs["t1_u"].shape == (NQ, 16)
        assert specs["u"].warm and specs["t1_u"].warm
    else:
        assert not any(s.warm for s in specs.values())
        assert "u" not in specs and "t1_u" not in specs


@pytest.mark.parametrize("scaling, extra", [("delayed", {"history", "te_multiplier"}),
                                            ("current", set()), ("none", set())])
def test_observed_policies_have_no_estimator_state(scaling, extra):
    """delayed/current/none: common state (+ delayed history), no σ or α."""
    specs = _plan(scaling=scaling).state_specs()
    names = {s.name for s in specs}
    assert names == {"steps", "cached_steps", "bound", "scale", "amax", "max_scaled",
                     "max_scaled_ever", "overflow_heads", "overflow_steps"} | extra


def test_auto_alpha_state_has_the_calibration_buffers():
    """auto-α records ratios for calib_steps steps per scale."""
    specs = {s.name: s for s in _plan(alpha="auto", calib_steps=7).state_specs()}
    assert specs["ratios"].shape == (7, NQ)
    assert {"calib_count", "calibrated", "alpha_emp", "alpha_final", "alpha"} <= set(specs)


@pytest.mark.parametrize("scaling", ["delayed", "current", "none"])
def test_weight_names_are_empty_without_estimators(scaling):
    """Observed-max policies never read the weights."""
    assert _plan(scaling=scaling).weight_names == ()


def test_weight_names_are_the_sites_weight_nodes_for_geometry():
    """Geometry reads every node its bound is computed from, in the site's order."""
    site = _site(terms=(_term(), _term(width=16, weight="w2")))
    plan = _plan(site)
    assert plan.weight_names == site.weight_nodes
    assert plan.weight_names == ("w", "b", "gain", "w2")


# --------------------------------------------------------------------------------------
# burn_in_variant
# --------------------------------------------------------------------------------------

def test_burn_in_variant_of_a_fused_plan_is_explicit_and_calibrating():
    """Auto-α burn-in observes max|S|: explicit lowering, calibrating, original untouched."""
    plan = _plan(alpha="auto")
    assert plan.lowering == "fused" and not plan.calibrating and not plan.observes
    burn = burn_in_variant(plan)
    assert burn.calibrating and burn.lowering == "explicit" and burn.observes
    assert burn.policy is plan.policy and burn.key == plan.key and burn.n_scale == plan.n_scale
    assert plan.lowering == "fused" and not plan.calibrating


def test_burn_in_variant_keeps_the_inplace_lowering():
    """An explicit model attention stays in place during the burn-in."""
    plan = _plan(_site(kind="explicit", node="softmax", score_op="matmul"), alpha="auto")
    burn = burn_in_variant(plan)
    assert burn.lowering == "inplace" and burn.calibrating


def test_burn_in_variant_of_an_explicit_plan_stays_explicit():
    """Already explicit (e.g. training on CPU): unchanged lowering, now calibrating."""
    plan = _plan(ctx=GraphContext(device="cpu", training=True), alpha="auto")
    burn = burn_in_variant(plan)
    assert burn.lowering == "explicit" and burn.calibrating
    assert burn.lowering_reason == plan.lowering_reason


def _measured_site() -> AttentionSite:
    """A site the weights cannot bound, carrying its form bounded by measured q and k."""
    def observed(name, n):
        return Side(Source("measured", name, 1), None, "observed",
                    tuple((h,) for h in range(n)), observed_axes=(1, 3))
    measured = _site(terms=(Term(observed("q", NQ), observed("k", NKV)),),
                     bound_by="measured", unbounded_reason="no normalization before `q_proj`")
    return _site(supported=False, reason="no normalization before `q_proj`",
                 measured=measured)


def test_a_site_the_weights_cannot_bound_is_planned_on_its_measured_operands():
    site = _measured_site()
    plan = _plan(site)
    assert isinstance(plan, SitePlan) and plan.site is site.measured
    assert plan.certified and plan.site.cached_keys is False
    assert plan.site.parameter_nodes == ()          # q and k are activations
    (estimator,) = plan.policy.estimators
    assert type(estimator).__name__ == "MeasuredOperands"


def test_fp8_qkv_on_a_measured_site_falls_back_with_the_reason():
    plan = _plan(_measured_site(), lowering="fp8_qkv")
    assert plan.lowering != "fp8_qkv" and "measured at every call" in plan.qkv_fallback


def test_fp8_qkv_takes_a_mask_and_its_fallback_names_every_other_modifier():
    """The plan asks each modifier whether the FP8 q/k/v kernel takes it (``fp8_qkv``)."""
    value = _side(NKV, 2 * NQ * DH)
    masked = _plan(_site(value=value, modifiers=(Mask("sdpa"),)), lowering="fp8_qkv")
    assert masked.lowering == "fp8_qkv" and masked.qkv_fallback == ""
    others = (Mask("sdpa"), Softcap("mul", 30.0), Sink("cat", param="sinks"),
              PositionBias("add", 1.0), Softcap("mul_1", 5.0))
    plan = _plan(_site(value=value, modifiers=others), lowering="fp8_qkv")
    assert plan.lowering == "fused"
    assert plan.qkv_fallback == "score modifiers ['position_bias', 'sink', 'softcap'] before " \
                               "the softmax"
