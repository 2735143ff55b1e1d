"""The runtime of one compiled graph: the host side of every call, and the state's life.

Who writes a site's state, by phase (one writer each):

* creation and checkpoint load: ``state.GeoscaleState`` (spec fills, restored values);
* cold start (first call, or weights loaded without their scaling state): ``GraphRuntime``
  through the policy's estimators, on the host, before the graph runs;
* inference, whenever the weights changed (their version counters): ``GraphRuntime``
  through ``ScalingPolicy.refresh``, on the host, before the graph runs — the weights' part
  of the bound, which the inference graph (one compiled variant, ``reuse``) only reads;
* every step: the compiled graph (in-place updates of its extra inputs);
* end of the auto-α burn-in: :func:`finalize_calibration`, once, on the host.

``GraphRuntime.__call__`` is what Dynamo calls: cold start if needed, pick the compiled
variant (auto-α burn-in, or the main one), refresh the weights' part if needed, run it with the state appended; when the graph
raises (e.g. its non-finite-bound assertion), check the sites' weights on the host and raise
``NonFiniteWeights`` naming the site and the parameter instead.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
import zlib
from typing import Any, Callable, Sequence

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node
from torch.utils.weak import WeakIdKeyDictionary

from geoscale_fx.runtime.key_norm_trust import KeyNormTrust
from geoscale_fx.runtime.key_trust_protocol import KeyTrust
from geoscale_fx.analysis.fx.dtensor import to_local
from geoscale_fx.analysis.evaluate import ParamEvaluator
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, parameter_name, upstream
from geoscale_fx.analysis.fx.module_names import graph_tensor_names
from geoscale_fx.planning.plan import SitePlan
from geoscale_fx.core.errors import NonFiniteWeights, non_finite_entries
from geoscale_fx.sites.state import SiteState
from geoscale_fx.runtime.version_record import VersionRecord

__all__ = ["GraphRuntime", "finalize_calibration", "check_finite"]

log = logging.getLogger("geoscale_fx")


class _Lazy:
    """A value built on first use (a compiled variant of a graph)."""

    def __init__(self, build: Callable[[], Any]):
        self._build, self._value = build, None

    def get(self):
        if self._value is None:
            self._value = self._build()
            self._build = None       # it holds the example inputs (the model's parameters)
        return self._value


class _Binding:
    """One module's states in a graph, and what its last call left: ``weights``, a record of
    the weights the last refresh read (invalid: refresh on the next call); ``record``, of the
    running key maxima and caches (written by the key trust only, in its ``RecordLayout``)."""

    __slots__ = ("states", "tensors", "weights", "record", "runnings")

    def __init__(self, plans: list[SitePlan], states: list[SiteState]):
        self.states = states
        self.tensors = [t for p, s in zip(plans, states) for t in s.tensors(p.state_names)]
        self.weights, self.record = VersionRecord(), VersionRecord()
        self.runnings: list[torch.Tensor] | None = None


class GraphRuntime:
    """The callable returned to Dynamo for one graph with rewritten sites.

    One graph may serve several modules: Dynamo reuses a per-block compile for every block
    of the same code (parameters are graph inputs). Each module's parameters (the *owner*:
    the first parameter a site reads) get their own states, bound on the first call that
    passes them (``bind(args)`` creates them, cold); a call costs one ``id`` lookup.

    Fast path (inference): while every weight the bounds read, running key maximum and past
    cache is the tensor the binding's last call left, unwritten (``VersionRecord``), nothing
    is refreshed nor re-measured.
    """

    def __init__(self, gm: GraphModule, example_inputs: Sequence[Any], plans: list[SitePlan],
                 states: list[SiteState], variants: dict[str, Callable[[], Callable]],
                 calib_steps: int, on_run: Callable[[], None],
                 bind: Callable[[Sequence[Any]], list[SiteState]] | None = None):
        self.gm, self.plans, self.states = gm, plans, states
        self.kinds = ValueKinds(gm.graph, example_inputs)
        self.by_name = {n.name: n for n in gm.graph.nodes}
        #: the model's name of a tensor, by identity (``analysis.fx.module_names``)
        self.name_of = graph_tensor_names(gm)
        self.variants = {name: _Lazy(build) for name, build in variants.items()}
        self._main = "reuse" if "reuse" in self.variants else "predict"
        self._auto_alpha = any(p.options.alpha == "auto" for p in plans)
        self.calib_steps = calib_steps
        self.on_run = on_run
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.param_positions = _bound_parameter_positions(gm, plans, placeholders, self.kinds)
        self.full_steps = self.reused_steps = 0   # calls that refreshed the bound or not
        self.fast_steps = 0     # of the reused ones, those that checked nothing else (fast path)
        self.symbolic = any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
            isinstance(v, torch.SymInt) for n in placeholders
            for v in [n.meta.get("example_value")])
        self.bind = bind
        self.owner_index = _owner_index(gm, plans, self.kinds)
        self.key_trust: KeyTrust = KeyNormTrust(gm, plans)
        self.remeasured_caches = 0   # calls whose cached keys were measured on the host
        self.bound = WeakIdKeyDictionary()          # owner tensor → its _Binding
        self._by_id: dict[int, tuple[weakref.ref, _Binding]] = {}   # its per-call cache
        self._own = _Binding(plans, states)
        if self.owner_index is not None and self.owner_index < len(example_inputs):
            self.bound[example_inputs[self.owner_index]] = self._own

    @property
    def main(self) -> str:
        """The variant every call runs once auto-α's burn-in is over: ``reuse`` (inference:
        the weights' part of the bound refreshed on the host) or ``predict``."""
        return self._main

    def warm_up(self) -> None:
        """Compile the variant the next call uses now (compile errors surface here), and with
        symbolic shapes every variant: compiled later, outside Dynamo's compile, a graph would
        be specialized to the example shapes. With static shapes the main one after a
        burn-in is compiled when a call first needs it."""
        self.variants["burn_in" if self.calibrating(self.states) else self.main].get()
        if self.symbolic:
            for variant in self.variants.values():
                variant.get()

    def _binding(self, args) -> _Binding:
        if self.owner_index is None or self.bind is None:
            return self._own
        owner = args[self.owner_index]
        hit = self._by_id.get(id(owner))
        if hit is not None and hit[0]() is owner:   # alive, so its id is its own
            return hit[1]
        found = self.bound.get(owner)
        if found is None:
            found = _Binding(self.plans, self.bind(args))
            self.bound[owner] = found
            log.info("geoscale: a compiled graph serves another module: state %s",
                     [s.key for s in found.states])
        by_id, key = self._by_id, id(owner)
        # the entry leaves with its owner (it holds the owner's states)
        drop = lambda ref: by_id.get(key, (None,))[0] is ref and by_id.pop(key)  # noqa: E731
        with contextlib.suppress(TypeError):   # else looked up in ``bound`` every call
            by_id[key] = (weakref.ref(owner, drop), found)
        return found

    def __call__(self, *args):
        binding = self._binding(args)
        if self._unchanged(args, binding):
            out = self._run("reuse", args, binding)
            self.key_trust.recorded(args, out, binding.runnings, binding.record)
            self.reused_steps += 1
            self.fast_steps += 1
            self.on_run()
            return out
        return self._full_call(args, binding)

    def _unchanged(self, args, binding: _Binding) -> bool:
        """No site cold, no burn-in, and every weight, running key maximum and cache is as
        this binding's last inference call left it: no refresh, no trust check to do."""
        for state in binding.states:
            if state.cold:
                return False
        return self._main == "reuse" and not (self._auto_alpha and
                                              self.calibrating(binding.states)) and \
            binding.weights.holds_args(args, self.param_positions) and \
            self.key_trust.holds(args, binding.runnings, binding.record)

    def _run(self, variant: str, args, binding: _Binding):
        try:
            return self.variants[variant].get()(*args, *binding.tensors)
        except RuntimeError:
            self.diagnose(args)  # an in-graph assertion: name the parameter if it is one
            raise

    def _full_call(self, args, binding: _Binding):
        """Cold start, refresh, re-measure of untrusted caches, each if needed; the graph."""
        states, trust, record = binding.states, self.key_trust, binding.record
        if any(s.cold for s in states):
            self._cold_start(args, [(p, s) for p, s in zip(self.plans, states) if s.cold])
            binding.weights.valid = False
        burn_in = self._auto_alpha and self.calibrating(states)
        variant = "burn_in" if burn_in else self._main
        reuse = variant == "reuse"
        if binding.runnings is None:
            binding.runnings = trust.runnings(states)
        # the weights changed since the last refresh (any in-place write, another tensor or
        # storage; inference-mode tensors keep no version: every call)
        refresh = reuse and not binding.weights.holds_args(args, self.param_positions)
        if refresh:
            self._refresh(args, states)
        if trust.entries:
            self.remeasured_caches += trust.before(args, states)
        out = self._run(variant, args, binding)
        if reuse:
            binding.weights.update([args[i] for i in self.param_positions])
        if trust.entries:
            record.update(trust.kept(args, out, binding.runnings))
            trust.after(args, out, states, record)
        if burn_in:
            self._count_burn_in(states)
            binding.weights.valid = False   # the burn-in graph computed the bound in the graph
        if reuse and not refresh:
            self.reused_steps += 1
        else:
            self.full_steps += 1
        self.on_run()
        return out

    # ---- host-side phases ---------------------------------------------------------------
    def weights(self, args, plan: SitePlan) -> dict:
        """The values a site's bound reads (tensor parallel: the rank's local shards)."""
        evaluator = ParamEvaluator(self.gm, args, self.kinds)
        cache: dict = {}
        names = dict.fromkeys(plan.site.weight_nodes + plan.weight_names)
        return {n: to_local(evaluator.evaluate(self.by_name[n], cache)) for n in names}

    def _refresh(self, args, states: list[SiteState]) -> None:
        """Inference: the weights changed (or were never seen): recompute the weights' part
        of every site's bound on the host, where the ``reuse`` graph reads it."""
        for plan, state in zip(self.plans, states):
            weights = self.weights(args, plan)
            check_finite(plan, weights, self.by_name, self.name_of)
            plan.policy.refresh(weights, state.as_dict())
        counters["geoscale"]["weight_refreshes"] += 1

    def _cold_start(self, args, cold) -> None:
        for plan, state in cold:
            weights = self.weights(args, plan)
            check_finite(plan, weights, self.by_name, self.name_of)
            used = plan.policy.cold_start(weights, state.as_dict(), _generator(state))
            state.cold = False
            counters["geoscale"]["cold_starts"] += 1
            log.debug("geoscale: cold start of %s (%d power iterations)", plan.key, used)

    def diagnose(self, args) -> None:
        """Raise ``NonFiniteWeights`` naming the first site and parameter that is not finite."""
        for plan in self.plans:
            check_finite(plan, self.weights(args, plan), self.by_name, self.name_of)

    def calibrating(self, states: list[SiteState]) -> bool:
        """Auto-α: whether any site of this graph is still in its burn-in (host mirror)."""
        if not self._auto_alpha:
            return False
        for state in states:
            if state.calib_seen is None:  # one read after creation or a checkpoint load
                state.calib_seen = (self.calib_steps if bool(state.calibrated)
                                    else int(state.calib_count))
        return any(s.calib_seen < self.calib_steps for s in states)

    def _count_burn_in(self, states: list[SiteState]) -> None:
        for plan, state in zip(self.plans, states):
            if state.calib_seen < self.calib_steps:
                state.calib_seen += 1
                if state.calib_seen == self.calib_steps:
                    alpha = finalize_calibration(plan, state)
                    log.info("geoscale: %s calibrated: alpha_final %s", plan.site.name,
                             [round(a, 6) for a in alpha.tolist()])


def _bound_parameter_positions(gm: GraphModule, plans: list[SitePlan], placeholders: list,
                               kinds: ValueKinds) -> list[int]:
    """Positions of the parameter inputs the sites' bounds are computed from (the weights
    record of the reuse variant compares these only: an MLP weight never moves a bound,
    and a decode step's host work grows with the attention parameters, not with all)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    names = {n for p in plans for n in (p.site.parameter_nodes + (
        p.weight_names if p.lowering == "fp8_qkv" else ()))}
    starts = [by_name[n] for n in names if n in by_name]
    found = {n for n in upstream(starts) if n.op == "placeholder" and kinds.is_param(n)}
    return [i for i, n in enumerate(placeholders) if n in found]


def _owner_index(gm: GraphModule, plans: list[SitePlan], kinds: ValueKinds) -> int | None:
    """Position among the graph's inputs of the first parameter placeholder a site reads
    (a site bounded by its measured q and k may read none)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in gm.graph.nodes}
    for plan in plans:
        for name in plan.site.weight_nodes:
            for node in upstream([by_name[name]]):
                if node.op == "placeholder" and kinds.is_param(node):
                    return placeholders.index(node)
    return None


def _generator(state: SiteState) -> torch.Generator:
    """Cold-start randomness from the site's key alone: data-parallel replicas of a site
    (identical weights) start from identical power vectors, whatever their global seeds."""
    return torch.Generator().manual_seed(zlib.crc32(state.key.encode()))


def finalize_calibration(plan: SitePlan, state: SiteState) -> torch.Tensor:
    """Freeze ``α_final = quantile_q(r) · κ`` per scale from the recorded slack ratios.

    Raises ValueError when nothing was recorded or a ratio is not finite (a NaN α would
    silently disable the scale). Returns α_final.
    """
    count = int(state.calib_count.item())
    ratios = state.ratios[:count].double()
    if count == 0:
        raise ValueError(f"geoscale: auto-alpha calibration of attention site "
                         f"'{plan.site.name}' recorded no slack ratio")
    if not bool(torch.isfinite(ratios).all()):
        raise ValueError(f"geoscale: auto-alpha calibration of attention site "
                         f"'{plan.site.name}' saw a non-finite logit; α would be NaN")
    alpha_emp = torch.quantile(ratios, plan.options.quantile, dim=0)
    alpha_final = alpha_emp * plan.options.kappa
    with torch.no_grad():
        state.alpha_emp.copy_(alpha_emp)
        state.alpha_final.copy_(alpha_final)
        state.calibrated.fill_(1.0)
    state.calib_seen = plan.options.calib_steps
    return alpha_final


def check_finite(plan: SitePlan, weights: dict, by_name: dict[str, Node],
                 name_of: Callable[[Any], str | None] | None = None) -> None:
    """Raise ``NonFiniteWeights`` naming the site and the first parameter with inf/nan
    (``name_of``: the model's name of a tensor, by identity, for a graph serving another
    block than the one it was compiled for)."""
    for name, value in weights.items():
        bad = non_finite_entries(value) if isinstance(value, torch.Tensor) else 0
        if bad:
            label = (name_of(value) if name_of is not None else None) or \
                _param_label(by_name[name])
            raise NonFiniteWeights(
                f"geoscale: attention site '{plan.site.name}': parameter "
                f"'{label}' has {bad} non-finite value(s) out of "
                f"{value.numel()}; the logit bound (and the FP8 scale) would be NaN")


def _param_label(node: Node) -> str:
    if node.op == "placeholder":
        return parameter_name(node)
    names = [parameter_name(n) for n in node.all_input_nodes if n.op == "placeholder"]
    return f"{node.name} (from {', '.join(names)})" if names else node.name
