"""The ``geoscale`` torch.compile backend: analyse, plan, rewrite, then Inductor.

    model = torch.compile(model, backend="geoscale")                 # default options
    model = torch.compile(model, backend=geoscale_fx.backend(alpha="theory"))

For every graph Dynamo captures: ``analyze_graph`` finds the attention sites, each supported
site gets a ``SitePlan`` (lowering, α, state layout), ``rewrite`` replaces it, and the result
goes to ``compile_fx`` with the sites' state tensors as extra inputs. The returned callable
appends the state and, on a cold start (first call, or weights loaded without their scaling
state), initialises it from the current weights with the certified exact route.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule, Node

from geoscale_fx import bounds
from geoscale_fx.config import GeoscaleOptions
from geoscale_fx.passes.analyze import analyze_graph
from geoscale_fx.passes.evaluate import ParamEvaluator
from geoscale_fx.passes.graph_ops import ValueKinds, example_value, op_of, parameter_name
from geoscale_fx.passes.rewrite import rewrite, sdpa_call_options
from geoscale_fx.passes.site_model import AttentionSite
from geoscale_fx.scaling import SitePlan, cold_start, finalize_calibration, state_specs
from geoscale_fx.state import GeoscaleState, SiteState, site_key

__all__ = ["GeoscaleBackend", "SiteRecord", "backend", "geoscale_backend"]

log = logging.getLogger("geoscale_fx")

_BACKENDS: "weakref.WeakSet[GeoscaleBackend]" = weakref.WeakSet()


@dataclass
class SiteRecord:
    """What the backend did with one site (for ``report``)."""
    site: AttentionSite
    plan: SitePlan | None
    state: SiteState | None
    owner: int                  # id() of the query weight parameter: which model it belongs to
    note: str = ""


class GeoscaleBackend:
    """A configured backend; ``state`` holds every site's scaling state (see ``wrap``)."""

    def __init__(self, options: GeoscaleOptions | None = None, state: GeoscaleState | None = None,
                 owned: bool = False):
        self.options = options or GeoscaleOptions()
        self.state = state if state is not None else GeoscaleState()
        self.owned = owned
        self.records: dict[str, SiteRecord] = {}
        self.skipped: list[SiteRecord] = []
        self._keys: dict[tuple, str] = {}
        self.compiles = 0
        _BACKENDS.add(self)

    # ----------------------------------------------------------------------------------
    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]):
        self.compiles += 1
        sites = analyze_graph(gm, example_inputs, rope_bound=self.options.rope_bound)
        if not sites:
            log.info("geoscale: no attention in this graph (%d nodes); compiled unchanged",
                     len(gm.graph.nodes))
            return self._compile(gm, list(example_inputs), fused=False)
        plans, states = self._plan_all(gm, example_inputs, sites)
        if not plans:
            return self._compile(gm, list(example_inputs), fused=False)
        tensors = [t for s in states for t in s.tensors()]
        variants = self._variants(gm, example_inputs, plans, states, tensors)
        lowerings = [p.lowering for p in plans]
        log.info("geoscale: %d attention sites, %d rewritten (fused %d, explicit %d, in-place "
                 "%d), %d left as is", len(sites), len(plans), lowerings.count("fused"),
                 lowerings.count("explicit"), lowerings.count("inplace"),
                 len(sites) - len(plans))
        (variants["burn_in"] if self._calibrating(plans, states) else variants["predict"]).get()
        return self._runner(gm, example_inputs, plans, states, tensors, variants)

    def _plan_all(self, gm, example_inputs, sites) -> tuple[list, list]:
        """A plan and its state for every site that can be rewritten; the rest logged."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        owners = {n.name: example_inputs[i] for i, n in enumerate(placeholders)
                  if i < len(example_inputs)}
        plans, states = [], []
        for site in sites:
            plan, note = self._plan(site, sites, gm, owners) if site.supported else \
                (None, site.reason)
            owner = id(owners.get(site.q.weight)) if site.supported else 0
            if plan is None:
                log.warning("geoscale: attention %s (%s) left as is: %s", site.name, site.node,
                            note)
                self.skipped.append(SiteRecord(site, None, None, owner, note))
                continue
            state = self.state.get_or_create(plan.key, state_specs(plan), _device_of(gm, site))
            with torch.no_grad():  # α (α0 for auto) follows the plan: "theory" tracks L
                state.alpha.fill_(plan.alpha)
            self.records[plan.key] = SiteRecord(site, plan, state, owner, note)
            plans.append(plan)
            states.append(state)
        return plans, states

    def _variants(self, gm, example_inputs, plans, states, tensors) -> dict:
        """The compiled graphs this graph may run, built on first use: the predictive one,
        and for auto-α the burn-in one (explicit lowering, slack ratios recorded)."""
        variants = {"predict": _Lazy(lambda: self._build(gm, example_inputs, plans, states,
                                                         tensors))}
        if self.options.alpha == "auto":
            burn_in = [replace(p, calibrating=True, lowering="inplace" if p.lowering == "inplace"
                               else "explicit") for p in plans]
            variants["burn_in"] = _Lazy(lambda: self._build(gm, example_inputs, burn_in, states,
                                                            tensors))
        return variants

    def _build(self, gm, example_inputs, plans, states, tensors):
        new_gm = rewrite(gm, plans, [s.names for s in states])
        return self._compile(new_gm, list(example_inputs) + tensors,
                             fused=any(p.lowering == "fused" for p in plans))

    # ----------------------------------------------------------------------------------
    def _runner(self, gm, example_inputs, plans, states, tensors, variants):
        kinds = ValueKinds(gm.graph, example_inputs)
        by_name = {n.name: n for n in gm.graph.nodes}

        def run(*args):
            cold = [(p, s) for p, s in zip(plans, states) if s.cold]
            if cold:
                self._cold_start(gm, kinds, by_name, args, cold)
            calibrating = self._calibrating(plans, states)
            compiled = variants["burn_in" if calibrating else "predict"].get()
            try:
                out = compiled(*args, *tensors)
            except RuntimeError as exc:
                if "geoscale: non-finite" not in str(exc):
                    raise
                self._diagnose(gm, kinds, by_name, args, plans)
                raise
            if calibrating:
                self._count_burn_in(plans, states)
            return out
        return run

    # ----------------------------------------------------------------------------------
    def _calibrating(self, plans, states) -> bool:
        """Auto-α: whether any site of this graph is still in its burn-in (host mirror)."""
        if self.options.alpha != "auto":
            return False
        for state in states:
            if state.calib_seen is None:  # one read after creation or a checkpoint load
                state.calib_seen = (self.options.calib_steps if bool(state.calibrated)
                                    else int(state.calib_count))
        return any(s.calib_seen < self.options.calib_steps for s in states)

    def _count_burn_in(self, plans, states) -> None:
        for plan, state in zip(plans, states):
            if state.calib_seen < self.options.calib_steps:
                state.calib_seen += 1
                if state.calib_seen == self.options.calib_steps:
                    alpha = finalize_calibration(plan, state.as_dict())
                    log.info("geoscale: %s calibrated: alpha_final %s", plan.site.name,
                             [round(a, 6) for a in alpha.tolist()])

    def finalize_calibration(self) -> None:
        """Freeze α now from the ratios recorded so far (e.g. after a short data loader)."""
        for record in self.records.values():
            state = record.state
            if state is not None and "calibrated" in state.names and not bool(state.calibrated):
                finalize_calibration(record.plan, state.as_dict())
                state.calib_seen = self.options.calib_steps

    def _weights(self, gm, kinds, by_name, args, plan) -> dict:
        evaluator = ParamEvaluator(gm, args, kinds)
        cache: dict = {}
        return {name: evaluator.evaluate(by_name[name], cache) for name in plan.weight_names}

    def _cold_start(self, gm, kinds, by_name, args, cold) -> None:
        for plan, state in cold:
            weights = self._weights(gm, kinds, by_name, args, plan)
            _check_finite(plan, weights, by_name)
            cold_start(plan, weights, state.as_dict())
            state.cold = False
            log.debug("geoscale: cold start of %s", plan.key)

    def _diagnose(self, gm, kinds, by_name, args, plans) -> None:
        for plan in plans:
            _check_finite(plan, self._weights(gm, kinds, by_name, args, plan), by_name)

    # ----------------------------------------------------------------------------------
    def _key(self, site: AttentionSite, sites, owners: dict) -> str:
        """Stable across recompiles: module path, its n-th call in the graph, the weights."""
        occurrence = sum(1 for s in sites if s.name == site.name and s.index < site.index)
        identity = (site.name, occurrence, id(owners.get(site.q.weight)))
        if identity not in self._keys:
            taken = set(self._keys.values())
            name = site.name if self.owned else f"{site.name}@{len(self._keys)}"
            self._keys[identity] = site_key(name, taken)
        return self._keys[identity]

    def _plan(self, site: AttentionSite, sites, gm, owners) -> tuple[SitePlan | None, str]:
        opt = self.options
        if site.kind in ("mha", "encoder_layer"):
            return None, (f"{site.kind}: an opaque fused op ({site.node}); analysed, "
                          "not rewritten")
        if site.kind == "explicit":
            if op_of(_node(gm, site.node_name("scores"))) == "baddbmm":
                return None, "scores come from baddbmm, which adds the mask before the scale"
            lowering = "inplace"
        else:
            lowering, why = self._sdpa_lowering(site, gm)
            if why:
                log.info("geoscale: %s uses the explicit lowering: %s", site.name, why)
        if opt.rope_bound == "relative" and site.rope and opt.scaling == "geometry":
            return None, ("rope_bound='relative' is an analysis option (find_attention); "
                          "use 'norm_product' or 'interaction' in the backend")
        n_total = sum(s.n_q_heads for s in sites if s.supported)
        n_total = max(n_total, sum(r.site.n_q_heads for r in self.records.values()))
        weight_names = _weight_names(site)
        plan = SitePlan(site=site, options=opt, key=self._key(site, sites, owners), lowering=lowering,
                        weight_names=weight_names, alpha=_initial_alpha(opt, site, n_total),
                        n_heads_total=n_total)
        return plan, ""

    def _sdpa_lowering(self, site: AttentionSite, gm: GraphModule) -> tuple[str, str]:
        opt = self.options
        node = _node(gm, site.node)
        q = example_value(node.args[0])
        training = torch.is_grad_enabled() and any(
            isinstance(example_value(n), torch.Tensor) and example_value(n).requires_grad
            for n in gm.graph.nodes if n.op == "placeholder")
        reasons = []
        if opt.lowering == "explicit":
            reasons.append("lowering='explicit'")
        if opt.materializes_scores:
            reasons.append("audit / delayed / current / auto-alpha observe max|S|")
        if training and q.device.type == "cpu":
            reasons.append("flex_attention has no backward on CPU")
        if q.device.type == "cpu" and opt.compiler == "inductor" and _symbolic(gm):
            reasons.append("Inductor's CPU flex_attention template fails on graphs with "
                           "symbolic shapes (a dynamic recompile)")
        if sdpa_call_options(node)["dropout_p"] > 0:
            reasons.append("attention dropout")
        if reasons:
            if opt.lowering == "fused":
                log.warning("geoscale: %s cannot use the fused lowering (%s)", site.name,
                            "; ".join(reasons))
            return "explicit", "; ".join(reasons)
        return "fused", ""

    # ----------------------------------------------------------------------------------
    def _compile(self, gm: GraphModule, inputs: list, fused: bool):
        compiler = self.options.compiler
        if compiler == "eager":
            return gm.forward
        if compiler == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, inputs)
        from torch._inductor.compile_fx import compile_fx

        # Inductor's CPU flex_attention template cannot take fused epilogues
        patches = {"epilogue_fusion": False} if fused else None
        return compile_fx(gm, inputs, config_patches=patches)


# --------------------------------------------------------------------------------------

class _Lazy:
    """A value built on first use (a compiled variant of a graph)."""

    def __init__(self, build: Callable[[], Any]):
        self._build, self._value = build, None

    def get(self):
        if self._value is None:
            self._value = self._build()
        return self._value


def _node(gm: GraphModule, name: str) -> Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _symbolic(gm: GraphModule) -> bool:
    """Whether Dynamo gave this graph symbolic (dynamic) shapes."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = example_value(node)
        if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in value.shape)):
            return True
    return False


def _device_of(gm: GraphModule, site: AttentionSite) -> torch.device:
    value = example_value(_node(gm, site.q.weight))
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


def _weight_names(site: AttentionSite) -> tuple[str, ...]:
    names: list[str] = []
    for proj in (site.q, site.k):
        for name in (proj.weight, proj.bias, *[v for _, v in proj.channel_ops]):
            if isinstance(name, str) and name not in names:
                names.append(name)
    return tuple(names)


def _initial_alpha(opt: GeoscaleOptions, site: AttentionSite, n_total: int) -> float:
    policy = opt.alpha0 if opt.alpha == "auto" else opt.alpha
    if policy == "theory":
        length = max(site.q_len, site.kv_len, 1)
        return bounds.alpha_min(site.model_dim, site.head_dim, max(n_total, 1), length,
                                opt.delta)
    return float(policy)


def _check_finite(plan: SitePlan, weights: dict, by_name: dict) -> None:
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and \
                value.device.type != "meta" and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ValueError(
                f"geoscale: attention site '{plan.site.name}': parameter "
                f"'{_param_label(by_name[name])}' has {bad} non-finite value(s) out of "
                f"{value.numel()}; the logit bound (and the FP8 scale) would be NaN")


def _param_label(node: Node) -> str:
    if node.op == "placeholder":
        return parameter_name(node)
    names = [parameter_name(n) for n in node.all_input_nodes if n.op == "placeholder"]
    return f"{node.name} (from {', '.join(names)})" if names else node.name


_DEFAULT: GeoscaleBackend | None = None


def geoscale_backend(gm: GraphModule, example_inputs: Sequence[Any]):
    """The backend registered as ``torch.compile(..., backend="geoscale")`` (default options)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = GeoscaleBackend()
    return _DEFAULT(gm, example_inputs)


def backend(**options) -> GeoscaleBackend:
    """A configured backend: ``torch.compile(model, backend=geoscale_fx.backend(alpha="theory"))``."""
    return GeoscaleBackend(GeoscaleOptions.from_kwargs(**options))
