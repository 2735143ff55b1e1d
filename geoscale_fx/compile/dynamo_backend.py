"""The ``geoscale`` torch.compile backend: analyse, plan, rewrite, then Inductor.

    model = torch.compile(model, backend="geoscale")                 # default options
    model = torch.compile(model, backend=geoscale_fx.backend(alpha="theory"))

For every graph Dynamo captures: ``analyze_graph`` finds the attention sites (plain data),
``plan_site`` decides for each whether and how it is rewritten (the only place that does),
``rewrite`` replaces the planned ones, and the result goes to ``compile_fx`` with the sites'
state tensors as extra inputs. The returned ``GraphRuntime`` appends the state and owns its
host-side life (cold start, auto-α burn-in). ``counters["geoscale"]`` counts graphs, sites
found, rewrites per lowering and sites left as is.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Sequence

import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch.fx import GraphModule
from torch.utils.weak import WeakIdKeyDictionary

from geoscale_fx.compile.backend_registry import BACKENDS
from geoscale_fx.compile.backend_sites import (SiteRecord, global_heads, graph_context,
                                       placeholder_values, site_device, site_owners)
from geoscale_fx.compile import graph_cache
from geoscale_fx.compile.inductor import compile_fx
from geoscale_fx.options.config import GeoscaleOptions
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.dynamo_code import note_compile
from geoscale_fx.compile.aten_trace import aten_graph
from geoscale_fx.analysis.fx.activation_checkpoint import inline_activation_checkpoints
from geoscale_fx.analysis.fx.module_names import attach_model, frame_root, graph_names
from geoscale_fx.compile.rewrite import rewrite
from geoscale_fx.planning.plan import (
    SitePlan, Skip, burn_in_variant, plan_site, reuse_variant, runnable,
)
from geoscale_fx.runtime.graph_runtime import GraphRuntime, finalize_calibration
from geoscale_fx.sites.model import AttentionSite
from geoscale_fx.sites.state import GeoscaleState, SiteState, site_key

__all__ = ["GeoscaleBackend", "backend", "geoscale_backend"]

log = logging.getLogger("geoscale_fx")


class GeoscaleBackend:
    """A configured backend; ``state`` holds every site's scaling state (see ``wrap``)."""

    def __init__(self, options: GeoscaleOptions | None = None, state: GeoscaleState | None = None,
                 owned: bool = False, model: torch.nn.Module | None = None):
        self.options = options or GeoscaleOptions()
        if self.options.scaling == "geometry" and self.options.estimator == "power":
            log.warning("geoscale: estimator='power' is the paper's warm power iteration, a "
                        "lower bound of σ once the weights change: scales after the first "
                        "step are not certified (report() says so per site); the default "
                        "estimator='schatten' (and 'exact') is")
        self.state = state if state is not None else GeoscaleState()
        self.owned = owned
        #: the model this backend compiles (``wrap``, ``apply_``, ``compile_blocks``; held
        #: weakly): its sites are named by their module's path in it, whichever graph (whole
        #: model or one block) they are in and however the frame reached them
        self._model = weakref.ref(model) if model is not None else None
        #: how many blocks one graph may serve (``compile_blocks``): N of alpha="theory"
        #: counts every block's heads, not only those of the block compiled first
        self.graph_multiplicity = 1
        self.records: dict[str, SiteRecord] = {}
        self.skipped: list[SiteRecord] = []
        self._keys: WeakIdKeyDictionary = WeakIdKeyDictionary()   # first owner → {identity: key}
        self._unowned_keys: dict[tuple, str] = {}
        self.compiles = 0
        self.runs = 0          # calls of compiled graphs with rewritten sites (host counter)
        self.graph_calls = 0   # calls of any graph this backend compiled (rewritten or not)
        #: GraphRuntime of every graph with rewritten sites, held weakly (Dynamo's cache
        #: entries hold them while their model lives)
        self._runtimes: list[weakref.ref] = []
        BACKENDS.register(self)     # report(model) finds it (backend_registry)

    @property
    def runtimes(self) -> list:
        """The GraphRuntime of every live graph with rewritten sites, in compile order."""
        return [r for r in (ref() for ref in self._runtimes) if r is not None]

    def for_dynamo(self) -> Callable:
        """What ``torch.compile`` is given: a function calling this backend through a weak
        reference. Dynamo keeps every backend it was handed for the process's life
        (``eval_frame.cached_backends``); through this, a converted model's backend — its
        records, graphs and the parameters they read — is freed with the model."""
        ref = weakref.ref(self)

        def geoscale(gm: GraphModule, example_inputs: Sequence[Any]):
            backend = ref()
            if backend is None:
                raise RuntimeError("geoscale: a graph was compiled for a model whose "
                                   "backend was freed")
            return backend(gm, example_inputs)

        return geoscale

    def forget_freed(self) -> None:
        """Drop the records (and, for a backend without a model of its own, the state) of
        sites whose parameters were all freed: a shared backend
        (``torch.compile(..., backend="geoscale")``) compiles many models in a process."""
        dead = [k for k, r in self.records.items() if r.had_owners and not len(r.owners)]
        for key in dead:
            del self.records[key]
            if not self.owned and key in self.state.sites:
                del self.state.sites[key]
        self.skipped = [r for r in self.skipped if not (r.had_owners and not len(r.owners))]

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model() if self._model is not None else None

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any]):
        self.compiles += 1
        counters["geoscale"]["graphs"] += 1
        note_compile()        # released with the codes of a converted model (dynamo_code)
        self.forget_freed()
        model = self.model if self.model is not None else frame_root(gm)
        gm = inline_activation_checkpoints(gm)   # attention inside checkpointed regions
        attach_model(gm, model)      # sites are named in it (``analysis.fx.module_names``)
        # the records' sites read the parameters weakly (site_logit_bound(record.site)
        # works while the model lives, and keeps nothing alive)
        sites = [runnable(s) for s in
                 analyze_graph(gm, example_inputs, rope_bound=self.options.rope_bound,
                               weak_inputs=True)]
        counters["geoscale"]["sites_found"] += len(sites)
        if not sites:
            log.info("geoscale: no attention in this graph (%d nodes); compiled unchanged",
                     len(gm.graph.nodes))
            return self._counted(self._compile(gm, list(example_inputs), fused=False))
        plans, states = self._plan_all(gm, example_inputs, sites)
        if not plans:
            return self._counted(self._compile(gm, list(example_inputs), fused=False))
        for plan in plans:   # once per graph, whatever variants it compiles
            counters["geoscale"][f"rewrite_{plan.lowering}"] += 1
            for modifier in plan.site.modifiers:
                counters["geoscale"][f"modifier_{modifier.kind}"] += 1
        lowerings = [p.lowering for p in plans]
        log.info("geoscale: %d attention sites, %d rewritten (fused %d, explicit %d, in-place "
                 "%d, fp8 q/k/v %d), %d left as is", len(sites), len(plans),
                 lowerings.count("fused"), lowerings.count("explicit"),
                 lowerings.count("inplace"), lowerings.count("fp8_qkv"),
                 len(sites) - len(plans))
        training = graph_context(gm, sites, placeholder_values(gm, example_inputs),
                                  0).training
        runtime = GraphRuntime(gm, example_inputs, plans, states,
                               self._variants(gm, example_inputs, plans, states, training),
                               self.options.calib_steps, self._count_run,
                               bind=lambda args: self._bind(gm, args, plans, sites))
        runtime.warm_up()
        self._runtimes.append(weakref.ref(runtime))
        return runtime

    def _count_run(self) -> None:
        self.runs += 1
        self.graph_calls += 1

    def _counted(self, compiled):
        """A graph without rewritten sites, counted when it runs: a wrapped model's call in
        which none of our graphs ran is one that Dynamo ran eagerly (``attach.GeoscaleCall``)."""
        def run(*args):
            self.graph_calls += 1
            return compiled(*args)

        return run

    # ---- planning -----------------------------------------------------------------------
    def _plan_all(self, gm, example_inputs, sites) -> tuple[list[SitePlan], list[SiteState]]:
        """A plan and its state for every site that can be rewritten; the rest recorded."""
        values = placeholder_values(gm, example_inputs)
        ctx = graph_context(gm, sites, values, self._n_heads_seen(), self.graph_multiplicity)
        plans, states = [], []
        for site in sites:
            owners = site_owners(gm, site, values)
            key, name = self._key(site, sites, owners, site.name)
            # the plans outlive the graph (Inductor's pre-grad passes keep a rewritten
            # graph's call targets, the sites' programs, for the process's life): the
            # plan's site has no reader of the graph's values (the runtime evaluates the
            # weights from its own inputs)
            result = plan_site(dataclasses.replace(site, _resolve=None), self.options, key,
                               ctx)
            if isinstance(result, Skip):
                self._skip(site, result.reason, owners)
                continue
            if site.bound_by == "measured":
                counters["geoscale"]["measured_sites"] += 1
                log.warning("geoscale: attention %s (%s) is bounded by its q and k measured at "
                            "every call, not from the weights: %s", site.name, site.node,
                            site.unbounded_reason)
            if result.qkv_fallback:
                counters["geoscale"]["fp8_qkv_fallback"] += 1
                log.warning("geoscale: %s keeps the %s logit lowering instead of fp8_qkv: %s",
                            site.name, result.lowering, result.qkv_fallback)
            if result.lowering == "fp8_qkv":
                log.info("geoscale: %s: FP8 q/k/v attention, %s%s", site.name,
                         result.qkv_kernel, f" ({result.lowering_reason})"
                         if result.lowering_reason else "")
            elif result.lowering_reason:
                log.info("geoscale: %s uses the explicit lowering: %s", site.name,
                         result.lowering_reason)
                if self.options.lowering == "fused":
                    log.warning("geoscale: %s cannot use the fused lowering (%s)", site.name,
                                result.lowering_reason)
            state = self.state.get_or_create(result.key, result.state_specs(),
                                             site_device(values, site))
            self.records[result.key] = SiteRecord(site, result, state, owners, name=name)
            plans.append(result)
            states.append(state)
        return plans, states

    def _bind(self, gm, args, plans: list[SitePlan], sites) -> list[SiteState]:
        """States of the modules whose parameters are ``args`` (a graph serving another
        block than the one it was compiled for): keyed like at compile time, cold if new."""
        values = placeholder_values(gm, args)
        names = graph_names(gm, values, self.model)   # the bound module's path
        by_name = {n.name: n for n in gm.graph.nodes}
        states = []
        for plan in plans:
            owners = site_owners(gm, plan.site, values)
            name = names.module(by_name[plan.site.node]) or plan.site.name
            key, name = self._key(plan.site, sites, owners, name)
            state = self.state.get_or_create(key, plan.state_specs(),
                                             site_device(values, plan.site))
            self.records[key] = SiteRecord(plan.site, plan, state, owners, name=name)
            states.append(state)
        return states

    def _skip(self, site: AttentionSite, reason: str, owners) -> None:
        counters["geoscale"]["left_as_is"] += 1
        if any(r.site.name == site.name for r in self.records.values()):
            reason = f"{reason} (it was rewritten in an earlier graph: FP8 scaling is off here)"
        log.warning("geoscale: attention %s (%s) left as is: %s", site.name, site.node, reason)
        self.skipped.append(SiteRecord(site, None, None, owners, reason))

    def _n_heads_seen(self) -> int:
        return sum(global_heads(r.site) for r in self.records.values())

    def _key(self, site: AttentionSite, sites, owners: WeakIdKeyDictionary,
             name: str) -> tuple[str, str]:
        """``(state key, display name)``, stable across recompiles: ``name`` (the site's
        module path in the model), its n-th call in the graph, the weights; a
        tensor-parallel site's key names the rank's shard (its state is its heads')."""
        occurrence = sum(1 for s in sites if s.name == site.name and s.index < site.index)
        identity = (site.name, occurrence)
        first = next(iter(owners.keys()), None)
        table = self._keys.setdefault(first, {}) if first is not None else self._unowned_keys
        if identity not in table:
            taken = {k for t in list(self._keys.values()) + [self._unowned_keys]
                     for k, _ in t.values()}
            shard = f".tp{'x'.join(map(str, site.shard.coordinate))}" if site.shard else ""
            if self.model is not None and site.supported:   # a path in the backend's model:
                key = site_key(name + (f"_{occurrence + 1}" if occurrence else "") + shard, ())
            else:
                base = name if self.owned else f"{name}@{len(taken)}"
                key = site_key(base + shard, taken)
            table[identity] = (key, name)
        return table[identity]

    # ---- compiled variants --------------------------------------------------------------
    def _variants(self, gm, example_inputs, plans, states, training: bool) -> dict:
        """Builders of the graphs this graph may run: one main graph — for inference with
        geometry scaling the one that reads the weights' part of the bound from the state
        (``reuse``: the runtime refreshes it on the host when the weights change, so a
        decode or serving step computes nothing from them), otherwise the one that computes
        it in the graph (``predict``: training, where the weights change every step) — and
        for auto-α the burn-in one (explicit lowering, slack ratios recorded)."""
        tensors = [t for p, s in zip(plans, states) for t in s.tensors(p.state_names)]
        names = [p.state_names for p in plans]

        def build(variant_plans):
            fused = any(p.lowering == "fused" for p in variant_plans)
            return lambda: self._compile_rewritten(gm, variant_plans, names,
                                                   list(example_inputs) + _static(tensors),
                                                   fused, training)

        if self.options.scaling == "geometry" and not training:
            variants = {"reuse": build([reuse_variant(p) for p in plans])}
        else:
            variants = {"predict": build(plans)}
        if self.options.alpha == "auto":
            variants["burn_in"] = build([burn_in_variant(p) for p in plans])
        return variants

    def _compile(self, gm: GraphModule, inputs: list, fused: bool):
        """A graph without rewritten sites, compiled as the options say."""
        compiler = self.options.compiler
        if compiler == "eager":
            return gm.forward
        if compiler == "aot_eager":
            return aot_eager(gm, inputs)
        return compile_fx(gm, inputs, config_patches=_inductor_patches(fused))

    def _compile_rewritten(self, gm: GraphModule, plans: list[SitePlan], names, inputs: list,
                           fused: bool, training: bool):
        """``gm`` with ``plans`` rewritten, compiled; under Inductor through its ATen trace
        (``compile.aten_trace``, above autograd for ``training``) so that AOTAutograd's cache
        can key it, the trace itself kept in geoscale's cache (``graph_cache``)."""
        rewritten = rewrite(gm, plans, names)
        if self.options.compiler != "inductor":
            return self._compile(rewritten, inputs, fused)

        patches = _inductor_patches(fused)
        context = torch._guards.TracingContext.try_get()
        key = graph_cache.graph_key(gm, inputs, (plans, names, training, fused)) \
            if graph_cache.enabled() and context is not None else None
        if key is None:
            counters["geoscale"]["graph_cache_bypass"] += 1
        else:
            cached = graph_cache.load(key, context.fake_mode)
            if cached is not None:
                try:
                    compiled = compile_fx(cached, inputs, config_patches=patches)
                    counters["geoscale"]["graph_cache_hit"] += 1
                    return compiled
                except Exception as exc:   # traced again below, and stored anew
                    counters["geoscale"]["graph_cache_unusable"] += 1
                    log.info("geoscale: the cached trace of a graph did not compile (%s: "
                             "%s); tracing again", type(exc).__name__, str(exc)[:200])
            counters["geoscale"]["graph_cache_miss"] += 1
        try:   # ATen operators only: AOTAutograd's cache can key the graph
            traced = aten_graph(rewritten, inputs, training)
            if traced is not rewritten:
                compiled = compile_fx(traced, inputs, config_patches=patches)
                if key is not None:    # stored once it compiled
                    graph_cache.store(key, traced)
                return compiled
        except Exception as exc:   # the trace only saves compile time: never lose the graph
            counters["geoscale"]["aten_trace_fallbacks"] += 1
            log.info("geoscale: the ATen trace of a graph did not compile (%s: %s); "
                     "compiling the rewritten graph as it is", type(exc).__name__,
                     (str(exc).splitlines() or [""])[0][:200])
        return compile_fx(rewritten, inputs, config_patches=patches)

    # ---- auto-α -------------------------------------------------------------------------
    def finalize_calibration(self) -> None:
        """Freeze α now from the ratios recorded so far (e.g. after a short data loader)."""
        for record in self.records.values():
            state = record.state
            if state is not None and "calibrated" in state.names and not bool(state.calibrated):
                finalize_calibration(record.plan, state)


# --------------------------------------------------------------------------------------

def _static(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state inputs as the compile should see them: inside Dynamo's compile, fake
    tensors of static shape (the plans fix them; AOTAutograd would otherwise give them fresh
    symbolic sizes under dynamic shapes, with no source to guard them by); outside (a variant
    compiled on a later call), the real tensors."""
    context = torch._guards.TracingContext.try_get()
    if context is None or context.fake_mode is None:
        return list(state)
    return [context.fake_mode.from_tensor(t, static_shapes=True) for t in state]


def _inductor_patches(fused: bool) -> dict:
    """No per-call size/stride asserts on the inputs: Dynamo's guards already check the
    model's, and the scaling state's shapes are fixed by the plans (a decode step has ~15
    state inputs per site; their asserts were a measurable share of its host time).
    Inductor's CPU flex_attention template cannot take fused epilogues."""
    return {"size_asserts": False, **({"epilogue_fusion": False} if fused else {})}


_DEFAULT: GeoscaleBackend | None = None


def geoscale_backend(gm: GraphModule, example_inputs: Sequence[Any]):
    """The backend registered as ``torch.compile(..., backend="geoscale")`` (default options)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = GeoscaleBackend()
    return _DEFAULT(gm, example_inputs)


def backend(**options) -> GeoscaleBackend:
    """A configured backend: ``torch.compile(model, backend=geoscale_fx.backend(alpha="theory"))``."""
    return GeoscaleBackend(GeoscaleOptions.from_kwargs(**options)
                           .without_kv_cache("geoscale_fx.backend"))
