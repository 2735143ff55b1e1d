"""``geoscale_fx.report(model)``: what the backend did at every attention, as rows and a table.

Per site (or per head with ``per_head=True``): σ (with the default ``estimator="schatten"``
its certified upper bound, at most d_h^(1/256) above it), the bound on |S|, α (auto-α: the frozen
α_final, the empirical quantile α_emp and how many slack ratios it came from), the scale, the
last and the largest scaled logit, overflow counts and FP8 utilization. Under tensor
parallelism a rank reports its own heads (by their global index) and ``tp`` says which of the
site's heads it holds. For RoPE sites with
the certified norm-product bound, "sigma" is empty and "norm_product" is ``‖A_q,h‖‖A_k,g(h)‖``,
the norm that bound uses. Values are read from the sites' state (one host read per call of
``report``, never per step). Scaled-logit figures need the logits, so they are present for
explicit lowerings and audits (``audit=True``) only. Sites left as is, and calls that Dynamo
ran eagerly (without FP8), are listed with their reason.

With ``lowering="fp8_qkv"`` a site's row holds the q, k and v descales (per kv head with
``per_head=True``, else the largest) and "last_scaled"/"max_scaled" the largest
``max|x|/δ`` of the three casts (the amax bounds are in the state: ``q_bound`` …); a site
that kept a logit lowering says why in "note". With an FP8 KV cache (``kv_cache="fp8"``)
"k_scale" and "v_scale" are the cache's scales (the largest over kv heads) and
"kv_saturated" counts the cached entries that reached ±R_max.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tabulate import tabulate
from torch import nn

from geoscale_fx.core import bounds
from geoscale_fx.compile.attach import geoscale_call
from geoscale_fx.compile.backend_registry import BACKENDS
from geoscale_fx.compile.backend_sites import SiteRecord
from geoscale_fx.compile.dynamo_backend import GeoscaleBackend
from geoscale_fx.sites.model import is_certified

__all__ = ["Report", "report", "site_records"]


def _note(plan) -> str | None:
    """What a row's numbers do not say: a bound from the measured q and k, an fp8_qkv
    fallback, position terms added to the logits after their FP8 round trip."""
    notes = []
    if plan.site.bound_by == "measured":
        notes.append("bound from q, k measured every call (the weights cannot bound it: "
                     f"{plan.site.unbounded_reason})")
    if plan.qkv_fallback:
        notes.append(f"fp8_qkv not applied: {plan.qkv_fallback}")
    biases = [m.node for m in plan.site.modifiers if m.kind == "position_bias"]
    if biases:
        notes.append(f"learned position term(s) {', '.join(f'`{b}`' for b in biases)} "
                     "added after the FP8 logits, in high precision")
    return "; ".join(notes) or None

_COLUMNS = ("site", "head", "tp", "lowering", "scaling", "sigma", "norm_product", "bound", "alpha",
            "alpha_emp",
            "ratios", "scale", "last_scaled", "max_scaled", "overflow_steps", "utilization",
            "steps", "cached_steps", "certified", "q_scale", "k_scale", "v_scale",
            "kv_saturated", "kv_nonfinite", "note")
_OPTIONAL = ("tp", "q_scale", "k_scale", "v_scale", "kv_saturated", "kv_nonfinite", "note")


@dataclass
class Report:
    rows: list[dict]
    skipped: list[dict]
    eager_calls: int = 0         # wrap/apply_ calls that Dynamo ran without our graphs
    #: wrap/apply_: graphs the backend compiled, the calls that compiled them and those
    #: calls' seconds, and how often the compiled call's region was renewed (``attach``)
    compiles: dict = field(default_factory=dict)

    def table(self, floatfmt: str = ".4g") -> str:
        columns = [c for c in _COLUMNS if c not in _OPTIONAL or any(r.get(c) is not None
                                                                     for r in self.rows)]
        body = tabulate([[r.get(c) for c in columns] for r in self.rows], headers=columns,
                        floatfmt=floatfmt)
        if self.skipped:
            body += "\n\nleft as is:\n" + tabulate(
                [[s["site"], s["reason"]] for s in self.skipped], headers=["site", "reason"])
        if self.eager_calls:
            body += (f"\n\n{self.eager_calls} call(s) ran eagerly, without FP8 scaling "
                     "(Dynamo fell back; see the warning logged at the time)")
        if self.compiles:
            c = self.compiles
            body += (f"\n\n{c['graphs']} graph(s) compiled in {c['compiling_calls']} "
                     f"compiling call(s), {c['compile_seconds']:.1f} s; the compiled call's "
                     f"region renewed {c['renewals']} time(s) (at {c['limit']} entries)")
        return body

    def __str__(self) -> str:
        return self.table()

    def __len__(self) -> int:
        return len(self.rows)


def site_records(model: Any) -> tuple[list[SiteRecord], list[SiteRecord]]:
    """(rewritten, left as is) records of the sites that belong to ``model``."""
    call = geoscale_call(model)
    backend = call.backend if call is not None else model if isinstance(
        model, GeoscaleBackend) else (getattr(model, "geoscale", None)
                                      or getattr(model, "_geoscale_backend", None))
    if isinstance(backend, GeoscaleBackend):
        return list(backend.records.values()), list(backend.skipped)
    inner = getattr(model, "_orig_mod", model)
    params = list(inner.parameters()) + list(inner.buffers()) if isinstance(
        inner, nn.Module) else []
    done, skipped = [], []
    for be in BACKENDS.live():
        done += [r for r in be.records.values() if r.belongs_to(params)]
        # a site with no parameter upstream cannot be attributed: shown for every model
        skipped += [r for r in be.skipped if r.belongs_to(params) or not len(r.owners)]
    return done, skipped


def kv_cache_manager(model: Any):
    """The ``KVCacheManager`` of a model converted with ``kv_cache=...``, else None."""
    for obj in (model, getattr(model, "model", None)):
        manager = getattr(obj, "_geoscale_kv_cache", None) if obj is not None else None
        if manager is not None:
            return manager
    return None


def _certified(record: SiteRecord) -> bool:
    """The last scale came from a proof (``site_model.is_certified`` with the step count)."""
    plan = record.plan
    return is_certified(plan.site, plan.options, plan.lowering, record.state.steps)


def _qkv_rows(record: SiteRecord, per_head: bool) -> list[dict]:
    """Rows of an fp8_qkv site: heads are kv heads (the descales' layout; the state holds
    each kv head's value once per query head of its group)."""
    plan = record.plan
    values = {name: t.detach().double().cpu() for name, t in record.state.as_dict().items()}
    n = record.site.n_kv_heads
    group = values["k_scale"].numel() // n
    rows = []
    for h in (range(n) if per_head else [None]):
        def pick(t, h=h):
            return float(t.reshape(-1)[h * group]) if h is not None else float(t.max())
        last = max(pick(values[f"{r}_max_scaled"]) for r in "qkv")
        rows.append({
            "site": record.name, "head": h if h is not None else f"{n} kv head(s)",
            "lowering": f"fp8_qkv ({plan.qkv_kernel})", "scaling": plan.options.scaling,
            "q_scale": pick(values["q_scale"]), "k_scale": pick(values["k_scale"]),
            "v_scale": pick(values["v_scale"]), "last_scaled": last,
            "max_scaled": max(pick(values[f"{r}_max_scaled_ever"]) for r in "qkv"),
            "overflow_steps": int(values["overflow_steps"]),
            "utilization": last / bounds.fp8_max(plan.options.fp8_format),
            "steps": int(values["steps"]), "cached_steps": int(values["cached_steps"]),
            "certified": _certified(record),
        })
    return rows


def _rows(record: SiteRecord, per_head: bool) -> list[dict]:
    if record.plan.lowering == "fp8_qkv":
        return _qkv_rows(record, per_head)
    st, plan = record.state, record.plan
    fmt_max = bounds.fp8_max(plan.options.fp8_format)
    values = {name: t.detach().double().cpu() for name, t in st.as_dict().items()}
    observed = plan.lowering != "fused" and plan.options.scaling != "none"
    n = values["scale"].numel()
    alpha = values.get("alpha")            # geometry only
    auto = plan.options.alpha == "auto"
    calibrated = auto and values["calibrated"].item() > 0
    if calibrated:
        alpha = values["alpha_final"]
    heads = range(n) if per_head else [None]
    shard = record.site.shard          # tensor parallel: the rank's heads, global indices
    global_head = (lambda h: shard.q_heads[h]) if shard is not None and n > 1 else (lambda h: h)
    rows = []
    for h in heads:
        pick = (lambda t: float(t.reshape(-1)[h])) if h is not None else \
            (lambda t: float(t.max()))
        rows.append({
            "site": record.name, "head": global_head(h) if h is not None else f"{n} scale(s)",
            "tp": shard.label if shard is not None else None,
            "lowering": plan.lowering, "scaling": plan.options.scaling,
            "sigma": pick(values["sigma"]) if "sigma" in values else None,
            "norm_product": pick(values["norm_product"]) if "norm_product" in values else None,
            "bound": pick(values["bound"]) if plan.options.scaling == "geometry" else None,
            "alpha": pick(alpha) if alpha is not None else None,
            "alpha_emp": pick(values["alpha_emp"]) if calibrated else None,
            "ratios": int(values["calib_count"]) if auto else None,
            "scale": pick(values["scale"]),
            "last_scaled": pick(values["max_scaled"]) if observed else None,
            "max_scaled": pick(values["max_scaled_ever"]) if observed else None,
            "overflow_steps": int(values["overflow_steps"]) if observed else None,
            "utilization": pick(values["max_scaled"]) / fmt_max if observed else None,
            "steps": int(values["steps"]),
            "cached_steps": int(values["cached_steps"]) if "cached_steps" in values else 0,
            "certified": _certified(record),
            "note": _note(plan),
        })
    return rows


def report(model: Any, per_head: bool = False) -> Report:
    """Rows (and ``str(report)`` a table) for every attention of a geoscale-compiled model."""
    done, skipped = site_records(model)
    rows = [row for record in done for row in _rows(record, per_head)]
    kv = kv_cache_manager(model)
    if kv is not None:           # FP8 KV cache: the scales of the last cache, saturations
        per_site = kv.rows()
        for row in rows:
            row.update(per_site.get(row["site"], {}))
    left = [{"site": r.name, "reason": r.note or r.site.reason} for r in skipped]
    call = geoscale_call(model)
    if call is None:
        return Report(rows, left)
    compiles = dict(graphs=call.backend.compiles, compiling_calls=call.compiling_calls,
                    compile_seconds=call.compile_seconds, renewals=call.region.renewals,
                    limit=call.region.limit)
    return Report(rows, left, call.eager_calls, compiles)
