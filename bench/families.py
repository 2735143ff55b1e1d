"""``python -m bench.families``: geoscale over every causal-LM family of transformers.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``hf_configs.causal_lm_types``)
the family's default config is shrunk (``hf_configs.tiny_model``; a family that cannot be built
is listed with the reason) and run on random token ids (B=1, T=32). Per family:

* **observed**: attention calls seen by spies on the eager forward, independently of geoscale's
  analysis: every ``F.scaled_dot_product_attention`` call (its logits ``S = s·q·kᵀ`` are
  recomputed from q and k, per query head, GQA keys repeated), and every softmax over the last
  axis of a ≥3-D tensor (``torch.softmax``, ``F.softmax``, ``Tensor.softmax``) outside one
  whose input is made of a *product of two activations* (``q·kᵀ``): a torch-function mode
  follows the values of the forward at run time (:class:`_Provenance`), so that a softmax over
  ``linear(x)`` — an MoE router's experts, hyper-connection stream weights — is not counted as
  an attention over keys (``Spy.not_attention`` counts those);
* **geoscale's view**: the sites (supported or not, and why) that the backend's analysis found
  compiling the ``scaling="none"`` wrapper below: ``analyze_graph`` on Dynamo's graphs, what
  ``find_attention`` runs (whose own capture is not repeated, to keep the sweep in 20 min;
  ``tests/test_bench_families.py`` checks the two agree);
* **silent misses**: observed calls per forward minus the sites one forward executes (an
  attention no site accounts for; a graph that runs for several layers — Dynamo compiles a
  layer's frame once after a graph break inside it — counts once per run,
  :func:`sites_per_forward`);
* **bounds**: ``site_logit_bound(site)`` against the observed ``max|S|`` (SDPA spy, when calls and
  sites pair one to one in execution order), and the audit's ``max_scaled·scale`` against its
  bound (``wrap(audit=True)``, both inputs in one batch of 2), on the random ids and on an
  adversarial input: the token whose input embedding has the largest norm, repeated over the
  whole sequence. "checks spy/audit" counts the (head, input) comparisons of each; a
  violation is one with observed > bound·(1+1e-5);
* ``scaling="none"`` under ``aot_eager`` against eager logits (``assert_close`` tolerances);
* overflows of the geometry audit (``overflow_steps`` summed over sites).

Every family runs in a worker process (``--jobs`` at once) under a time limit (SIGALRM).
Output: a table, a summary line,
``bench/results/<timestamp>/families.md`` (with every refusal reason in full), ``families.json``
and ``families.png`` (calls per family: supported, left as is, silent)::

    python -m bench.families                  # every family, 2 at a time (--jobs)
    python -m bench.families --only llama gpt2 bloom
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Spy", "adversarial_inputs", "backend_sites", "family_row", "summary",
           "coverage_plot", "main"]

TOLERANCE = 1e-5            # a violation: observed > bound · (1 + TOLERANCE)
SEQ_LEN = 32


@dataclass
class Call:
    """One attention call seen by a spy: ``amax`` = max|S| per query head (SDPA) or None."""
    kind: str                               # "sdpa" | "softmax"
    amax: torch.Tensor | None = None


#: labels of a value in the eager forward: made of the model's state and constants only; of
#: the inputs (an activation); of a product of two activations since the last projection
_STATE, _ACTIVATION, _PRODUCT = 0, 1, 2
#: contractions: their factors (position, keyword), the rest being added terms (bias); None:
#: every tensor argument is a factor
_TWO = ((0, "input"), (1, "other"))
_CONTRACTIONS = {"matmul": _TWO, "__matmul__": _TWO, "__rmatmul__": _TWO,
                 "mm": ((0, "input"), (1, "mat2")), "bmm": ((0, "input"), (1, "mat2")),
                 "linear": ((0, "input"), (1, "weight")),
                 "addmm": ((1, "mat1"), (2, "mat2")), "baddbmm": ((1, "batch1"), (2, "batch2")),
                 "addbmm": ((1, "batch1"), (2, "batch2")), "tensordot": ((0, "a"), (1, "b")),
                 "einsum": None, "bilinear": None}
#: a new computation starts after these (as in geoscale's own search for ``QKᵀ``)
_BARRIERS = {"layer_norm", "rms_norm", "group_norm", "scaled_dot_product_attention",
             "multi_head_attention_forward"}


class _Provenance(TorchFunctionMode):
    """Labels every tensor of an eager forward by what it is made of (:data:`_STATE`,
    :data:`_ACTIVATION`, :data:`_PRODUCT`): a tensor first seen as an argument is state if it is
    a parameter or one of ``state`` (the model's buffers), an activation otherwise; an op's
    output takes the highest label of its inputs, except that a contraction of two activations
    is a product, a contraction with state (a projection) or a normalization is an activation.
    A softmax is an attention over keys when its input is a product: the ``QKᵀ`` behind it,
    whatever the casts, scales, masks and reshapes between (a router's ``softmax(linear(x))``
    is not). Bookkeeping never changes what an op computes, and a failure of it is ignored."""

    def __init__(self, state=()):
        super().__init__()
        self._state = {id(t) for t in state}
        self._labels = WeakIdKeyDictionary()
        self.paused = False

    def label(self, t) -> int:
        if not isinstance(t, torch.Tensor):
            return _STATE
        got = self._labels.get(t)
        if got is None:
            got = _STATE if isinstance(t, torch.nn.Parameter) or id(t) in self._state \
                else _ACTIVATION
            self._labels[t] = got
        return got

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        try:
            self._propagate(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 — a spy never breaks the forward it watches
            pass
        return out

    def _propagate(self, func, args, kwargs, out) -> None:
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        label = max((self.label(t) for t in inputs), default=_STATE)
        if name in _CONTRACTIONS:
            where = _CONTRACTIONS[name]
            factors = inputs if where is None else [
                args[i] if i < len(args) else kwargs.get(key) for i, key in where]
            factors = [f for f in factors if isinstance(f, torch.Tensor)]
            if len(factors) < 2:               # an unknown signature: every tensor, to be safe
                factors = inputs
            if label >= _ACTIVATION:
                both = len(factors) >= 2 and all(self.label(f) >= _ACTIVATION for f in factors)
                label = _PRODUCT if both else _ACTIVATION
        elif name in _BARRIERS:
            label = min(label, _ACTIVATION)
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
            if args and isinstance(args[0], torch.Tensor):     # in place: the target changes
                self._labels[args[0]] = max(self.label(args[0]), label)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._labels[t] = label if t is not (args[0] if args else None) \
                    else max(self.label(t), label)


@dataclass
class Spy:
    """Counts attention calls of eager forwards (patches restored on exit, re-entry ignored):
    every SDPA call, and every softmax over the last axis of a ≥3-D tensor that is made of a
    product of two activations (:class:`_Provenance`); ``not_attention`` counts the other
    softmaxes over the last axis of a ≥3-D tensor (routers, gates). ``state``: the tensors that
    are the model's state besides its parameters (its buffers)."""
    calls: list[Call] = field(default_factory=list)
    not_attention: int = 0
    state: tuple = ()
    _depth: int = 0
    _provenance: _Provenance | None = None

    @contextmanager
    def watching(self):
        originals = {(torch, "softmax"): torch.softmax, (F, "softmax"): F.softmax,
                     (torch.Tensor, "softmax"): torch.Tensor.softmax,
                     (F, "scaled_dot_product_attention"): F.scaled_dot_product_attention}
        for (owner, name), fn in originals.items():
            setattr(owner, name, self._spied(name, fn))
        self._provenance = _Provenance(self.state)
        try:
            with self._provenance:
                yield self
        finally:
            self._provenance = None
            for (owner, name), fn in originals.items():
                setattr(owner, name, fn)

    def _spied(self, name: str, fn):
        def spied(*args, **kwargs):
            if self._depth == 0:
                paused, self._provenance.paused = self._provenance.paused, True
                try:                           # the spy's own computations are not followed
                    self._record(name, args, kwargs)
                finally:
                    self._provenance.paused = paused
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return spied

    def _record(self, name: str, args, kwargs) -> None:
        if name == "scaled_dot_product_attention":
            q, k = (list(args[:2]) + [kwargs.get("query"), kwargs.get("key")][len(args):])[:2]
            self.calls.append(Call("sdpa", _sdpa_amax(q, k, kwargs.get("scale"))))
            return
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if isinstance(x, torch.Tensor) and x.dim() >= 3 and dim in (-1, x.dim() - 1):
            if self._provenance.label(x) == _PRODUCT:
                self.calls.append(Call("softmax"))
            else:
                self.not_attention += 1


@torch.no_grad()
def _sdpa_amax(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """max over (batch, query, key) of |s·q·kᵀ| per query head (float64), or one value for
    q, k without a head axis."""
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k = q.double(), k.double()
    if q.dim() >= 4 and k.shape[-3] != q.shape[-3]:          # GQA: (B, n_kv, S, d) → n_q
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    logits = s * q @ k.transpose(-1, -2)                      # (B, n_q, T, S)
    if q.dim() < 4:
        return logits.abs().amax().reshape(1)
    return logits.abs().transpose(0, -3).reshape(q.shape[-3], -1).amax(-1)


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _observe(model, inputs: dict) -> tuple[torch.Tensor, list[Call]]:
    """Eager logits and the attention calls of one forward."""
    spy = Spy(state=tuple(model.buffers()))
    with spy.watching(), torch.no_grad():
        logits = _logits(model(**inputs))
    return logits, spy.calls


def adversarial_inputs(model, inputs: dict) -> dict:
    """``inputs`` with every token replaced by the one of largest input-embedding norm."""
    weight = model.get_input_embeddings().weight                # (vocab, d)
    token = int(weight.detach().float().norm(dim=-1).argmax())
    return {**inputs, "input_ids": torch.full_like(inputs["input_ids"], token)}


def _spy_ratios(calls: list[Call], sites: list) -> list[float]:
    """observed max|S| / logit_bound per head of the supported sites, when calls and sites
    pair one to one in execution order (else nothing to pair)."""
    from geoscale_fx.numerics.logit_bounds import site_logit_bound

    if len(calls) != len(sites):
        return []
    ratios = []
    for call, site in zip(calls, sites):
        if call.amax is None or not site.supported or site.bound_by == "measured":
            continue          # a measured site has no bound before the call: the audit checks it
        bound = site_logit_bound(site).double().reshape(-1)
        amax = call.amax if call.amax.numel() == bound.numel() else call.amax.max().reshape(1)
        bound = bound if amax.numel() == bound.numel() else bound.max().reshape(1)
        # a zero bound (Inkling-2's learned query starts at zeros) holds iff the logits are 0
        ratios += torch.where(bound > 0, amax / bound.clamp_min(1e-300),
                              torch.where(amax > 0, math.inf, 0.0)).tolist()
    return ratios


def _audit_ratios(wrapped) -> tuple[list[float], int]:
    """(observed/bound per head, overflow steps) of a geometry audit's last step."""
    import geoscale_fx

    rows = geoscale_fx.report(wrapped, per_head=True).rows
    ratios = [_ratio(r["max_scaled"] * r["scale"], r["bound"]) for r in rows
              if r.get("max_scaled") is not None and r.get("bound") is not None]
    overflows = sum(r["overflow_steps"] or 0 for r in rows
                    if r.get("overflow_steps") is not None and r["head"] in (0, None))
    return ratios, overflows


def _ratio(observed: float, bound: float) -> float:
    """observed/bound; a zero bound holds only for zero observations (then 0, else inf)."""
    return observed / bound if bound > 0 else (math.inf if observed > 0 else 0.0)


class _FamilyTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: int):
    """SIGALRM after ``seconds``, then every second: a handler's exception that some library
    catches and swallows (Dynamo falls back to eager on errors) is raised again."""
    def alarm(signum, frame):
        raise _FamilyTimeout(f"over the {seconds} s limit")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _short(reason: str, width: int = 90) -> str:
    """``reason`` on one line, cut to ``width`` characters."""
    reason = re.sub(r"\s+", " ", reason).strip()
    return reason if len(reason) <= width else reason[:width - 1] + "…"


def _reasons(sites: list, measured: bool = False) -> dict[str, int]:
    """Refusal reason -> sites refused for it (``measured``: why the weights do not bound
    the sites bounded by their measured q and k); node numbering dropped (`score_13` →
    `score`) so that the layers of one family share a reason."""
    out: dict[str, int] = {}
    for s in sites:
        if measured and s.bound_by == "measured":
            reason = s.unbounded_reason
        elif not measured and not s.supported:
            reason = s.reason
        else:
            continue
        reason = re.sub(r"`(\w+?)_\d+`", r"`\1`", reason)
        out[reason] = out.get(reason, 0) + 1
    return out


def _empty_row(model_type: str) -> dict:
    return {"model type": model_type, "built": False, "calls": None, "sites": None,
            "supported": None, "measured": None, "silent": None, "checks spy/audit": None,
            "max obs/bound": None, "violations": None,
            "none==eager": None, "overflows": None, "seconds": None, "reasons": {},
            "measured reasons": {}, "error": ""}


def _none_equals_eager(row: dict, model, inputs: dict, ref: torch.Tensor,
                       compiler: str = "aot_eager"):
    """``scaling="none"`` under ``compiler`` against the eager logits; the wrapper returned."""
    import geoscale_fx

    plain = geoscale_fx.wrap(model, scaling="none", compiler=compiler)
    with torch.no_grad():
        got = _logits(plain(**inputs))
    try:
        torch.testing.assert_close(got, ref)
        row["none==eager"] = True
    except AssertionError:
        row["none==eager"] = False
    return plain


def backend_sites(wrapped) -> list:
    """The sites geoscale's backend found compiling ``wrapped`` (rewritten and left as is), in
    execution order: ``analyze_graph`` on the graphs of that compile, as in ``find_attention``
    (which would trace the model once more: a third of a family's time)."""
    from geoscale_fx.api.reporting import site_records

    done, skipped = site_records(wrapped)
    return sorted((r.site for r in done + skipped), key=lambda s: (s.graph, s.index))


def sites_per_forward(model, inputs: dict) -> tuple[int, int, int]:
    """Attention sites executed by one forward, the supported ones among them and those of
    these bounded by their measured q and k (``AttentionSite.measured``): each
    Dynamo graph's sites times the number of times the graph ran (a graph break inside a
    layer makes Dynamo compile the layer's frame once and run that graph for every layer:
    one site, several calls)."""
    from geoscale_fx.analysis.analyze import analyze_graph
    from geoscale_fx.core import compat
    from geoscale_fx.planning.plan import runnable

    graphs: list[list] = []

    def counting(gm, example_inputs):
        entry = [gm, list(example_inputs), 0]
        graphs.append(entry)

        def run(*args):
            entry[2] += 1
            return gm.forward(*args)
        return run

    compiled = compat.compile_isolated(model, backend=counting, dynamic=False)
    with torch.no_grad():
        compiled(**inputs)
    executed = supported = measured = 0
    for gm, example, runs in graphs:
        sites = [runnable(s) for s in analyze_graph(gm, example)]
        executed += len(sites) * runs
        supported += sum(s.supported for s in sites) * runs
        measured += sum(s.bound_by == "measured" for s in sites) * runs
    return executed, supported, measured


def _audit(row: dict, model, inputs: list[dict], compiler: str = "aot_eager") -> list[float]:
    """The geometry audit on all inputs at once (one batch, one step): observed/bound per
    head; ``row["overflows"]`` set."""
    import geoscale_fx

    audited = geoscale_fx.wrap(model, audit=True, compiler=compiler)
    both = {**inputs[0], "input_ids": torch.cat([b["input_ids"] for b in inputs])}  # (2, T)
    with torch.no_grad():
        audited(**both)
    ratios, row["overflows"] = _audit_ratios(audited)
    return ratios


def _last_line(exc: Exception) -> str:
    """The line of a (Dynamo-wrapped) error that says what went wrong."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    said = [ln for ln in lines if re.match(r"^\w+(Error|Exception): ", ln)]
    return (said or lines or [""])[-1]


def _run_family(row: dict, model_type: str, compiler: str = "aot_eager") -> None:
    """Fill ``row`` for ``model_type`` (exceptions propagate to :func:`family_row`, except a
    failure of the ``none`` wrapper: the sites then come from ``find_attention``)."""
    import geoscale_fx
    from geoscale_fx.testing import hf_configs
    from geoscale_fx.planning.plan import runnable

    try:
        model = hf_configs.tiny_model(model_type)
    except ValueError as exc:
        row["error"] = f"not built: {exc}"
        return
    row["built"] = True
    inputs = [hf_configs.token_inputs(model, seq_len=SEQ_LEN)]
    inputs.append(adversarial_inputs(model, inputs[0]))
    ref, calls = _observe(model, inputs[0])
    row["calls"] = len(calls)
    try:
        sites = backend_sites(_none_equals_eager(row, model, inputs[0], ref, compiler))
    except Exception as exc:  # noqa: BLE001 — geoscale failing on a family is a finding
        if isinstance(exc, _FamilyTimeout) or "_FamilyTimeout" in str(exc):
            raise
        row["error"] = f"scaling='none' wrapper: {type(exc).__name__}: {_last_line(exc)}"
        sites = [runnable(s) for s in geoscale_fx.find_attention(model, **inputs[0])]
    executed, supported = len(sites), sum(s.supported for s in sites)
    measured = sum(s.bound_by == "measured" for s in sites)
    if executed < len(calls):      # one graph may run for several layers
        executed, supported, measured = sites_per_forward(model, inputs[0])
    row.update({"sites": executed, "supported": supported, "measured": measured,
                "silent": max(0, len(calls) - executed), "reasons": _reasons(sites),
                "measured reasons": _reasons(sites, measured=True)})
    spied = _spy_ratios(calls, sites) + _spy_ratios(_observe(model, inputs[1])[1], sites)
    _record_ratios(row, spied, [])       # kept if the audit raises
    if any(s.supported for s in sites):
        _record_ratios(row, spied, _audit(row, model, inputs, compiler))
    else:
        row["overflows"] = 0             # nothing rewritten: no FP8 cast to overflow


def _record_ratios(row: dict, spied: list[float], audited: list[float]) -> None:
    ratios = spied + audited
    row["checks spy/audit"] = f"{len(spied)}/{len(audited)}"
    row["max obs/bound"] = max(ratios) if ratios else None
    row["violations"] = sum(r > 1 + TOLERANCE for r in ratios)


def family_row(model_type: str, timeout: int = 60, compiler: str = "aot_eager") -> dict:
    """One row of the table for transformers ``model_type`` (see the module docstring); a
    failure or a timeout is recorded in ``row["error"]``, never raised. ``compiler`` runs
    geoscale's rewritten graphs (``"eager"``: without the AOT trace, for tests)."""
    row = _empty_row(model_type)
    start = time.perf_counter()
    try:
        with _time_limit(timeout):
            _run_family(row, model_type, compiler)
    except Exception as exc:  # noqa: BLE001 — any failure of a family is a row, not a crash
        # an alarm inside a compile reaches us wrapped (BackendCompilerFailed …)
        timed_out = isinstance(exc, _FamilyTimeout) or "_FamilyTimeout" in str(exc)
        row["error"] = "; ".join(filter(None, [row["error"], (
            f"timeout: over the {timeout} s limit" if timed_out
            else f"{type(exc).__name__}: {_last_line(exc)}")]))
        logging.getLogger("bench").debug("%s:\n%s", model_type, traceback.format_exc())
    finally:
        torch._dynamo.reset()
        gc.collect()
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _table_rows(rows: list[dict]) -> list[dict]:
    """Rows for the table: the reasons shortened and counted, an error in their place."""
    out = []
    for r in rows:
        reasons = "; ".join(f"{n}× {_short(k, 70)}" if n > 1 else _short(k, 70)
                            for k, n in r["reasons"].items())
        cell = {k: v for k, v in r.items() if k not in ("reasons", "measured reasons",
                                                         "error")}
        cell["max obs/bound"] = (f"{r['max obs/bound']:.3g}" if r["max obs/bound"] is not None
                                 else None)
        cell["reasons"] = _short(r["error"], 110) if r["error"] else reasons
        out.append(cell)
    return out


def summary(rows: list[dict]) -> dict:
    """Families built, share of the built families' attention calls that geoscale supports
    (supported sites / max(observed calls, sites)), silent misses, violations, and the rest."""
    built = [r for r in rows if r["built"]]
    ran = [r for r in built if r["calls"] is not None]
    calls = sum(max(r["calls"], r["sites"]) for r in ran)
    return {"families": len(rows), "built": len(built), "ran": len(ran),
            "calls": calls, "supported": sum(r["supported"] for r in ran),
            "measured": sum(r.get("measured") or 0 for r in ran),
            "supported %": 100 * sum(r["supported"] for r in ran) / calls if calls else 0.0,
            "silent misses": sum(r["silent"] for r in ran),
            "violations": sum(r["violations"] or 0 for r in ran),
            "none!=eager": sum(r["none==eager"] is False for r in ran),
            "overflows": sum(r["overflows"] or 0 for r in ran),
            "errors after build": sum(bool(r["error"]) for r in built)}


def _summary_line(s: dict) -> str:
    return (f"{s['built']}/{s['families']} families built ({s['ran']} ran to the end); "
            f"{s['supported']}/{s['calls']} attention calls supported ({s['supported %']:.1f}%; "
            f"{s['measured']} of them bounded by their measured q and k); "
            f"{s['silent misses']} silent misses; {s['violations']} violations; "
            f"{s['none!=eager']} none≠eager; {s['overflows']} overflows; "
            f"{s['errors after build']} errors after build")


def coverage_plot(rows: list[dict], path: Path) -> str:
    """(a) per family that ran, the share of its attention calls that are supported sites,
    sites left as is, silent misses (the count at the bar's end); (b) families per refusal
    reason (its first words)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r["calls"] is not None and max(r["calls"], r["sites"]) > 0]
    total = [max(r["calls"], r["sites"]) for r in ran]
    parts = {"supported": [r["supported"] for r in ran],
             "left as is": [r["sites"] - r["supported"] for r in ran],
             "silent miss": [r["silent"] for r in ran]}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 1.5 + 0.15 * len(ran)),
                                   gridspec_kw={"width_ratios": [1, 1.3]})
    names, left = [r["model type"] for r in ran], [0.0] * len(ran)
    for (label, values), color in zip(parts.items(), ("tab:green", "tab:orange", "tab:red")):
        shares = [v / t for v, t in zip(values, total)]
        ax1.barh(names, shares, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, shares)]
    for y, (end, n) in enumerate(zip(left, total)):
        ax1.text(end + 0.01, y, str(n), va="center", fontsize=5)
    ax1.invert_yaxis()
    ax1.tick_params(axis="y", labelsize=5)
    ax1.set_xlim(0, 1.12)
    ax1.set_xlabel("share of the attention calls of one forward (count at the right)")
    ax1.set_title("(a) coverage per family")
    fig.legend(*ax1.get_legend_handles_labels(), fontsize=8, ncol=3, loc="upper left")
    _reason_bars(ax2, rows)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name


def _reason_bars(ax, rows: list[dict]) -> None:
    """Families per refusal reason: its words, node names (`…`) elided, cut to 70 characters."""
    families: dict[str, set] = {}
    for r in rows:
        for reason in r["reasons"]:
            key = _short(re.sub(r"`[^`]*`", "·", reason), 70)
            families.setdefault(key, set()).add(r["model type"])
    ranked = sorted(families.items(), key=lambda kv: -len(kv[1]))
    ax.barh([k for k, _ in ranked], [len(v) for _, v in ranked], color="tab:orange")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=6)
    ax.set_xlabel("families")
    ax.set_title("(b) sites left as is: families per reason")


def _markdown(rows: list[dict], line: str, plot: str, seconds: float) -> str:
    table = tabulate(_table_rows(rows), headers="keys", tablefmt="github", missingval="")
    reasons = sorted({(k, r["model type"]) for r in rows for k in r["reasons"]})
    full = "\n".join(f"* `{t}`: {k}" for k, t in reasons) or "(none)"
    measured = sorted({(k, r["model type"]) for r in rows for k in r.get("measured reasons", {})})
    measured = "\n".join(f"* `{t}`: {k}" for k, t in measured) or "(none)"
    errors = "\n".join(f"* `{r['model type']}`: {r['error']}" for r in rows if r["error"])
    return (f"# geoscale over transformers' causal-LM families\n\ntorch {torch.__version__}, "
            f"B=1, T={SEQ_LEN}, {seconds:.0f} s in all.\n\n**Summary**: {line}\n\n{table}\n\n"
            f"## Refusal reasons in full\n\n{full}\n\n"
            "## Bounded by their measured q and k: why the weights do not bound them\n\n"
            f"{measured}\n\n## Errors\n\n{errors or '(none)'}\n\n"
            f"![{plot}]({plot})\n")


def _quiet() -> None:
    """Errors only (a worker's set-up): the table says what failed."""
    import transformers

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("geoscale_fx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)      # one core per family: --jobs families share the machine


def main(argv: list[str] | None = None) -> int:
    from geoscale_fx.testing.hf_configs import causal_lm_types

    parser = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types only")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per family")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="families run at once, one process each (default: 2)")
    parser.add_argument("--out", type=Path, help="results directory "
                        "(default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    _quiet()
    types = args.only or sorted(causal_lm_types())
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_quiet) as pool:
        for n, r in enumerate(pool.map(family_row, types, [args.timeout] * len(types)), 1):
            rows.append(r)
            print(f"[{n}/{len(types)}] {r['model type']}: {r['supported']}/{r['calls']} "
                  f"({r['seconds']} s) {_short(r['error'], 100)}", flush=True)
    seconds = time.perf_counter() - start
    line = _summary_line(summary(rows))
    print(tabulate(_table_rows(rows), headers="keys", missingval=""))
    print(f"\n{line}\n{seconds:.0f} s in all")
    plot = coverage_plot(rows, out / "families.png")
    (out / "families.md").write_text(_markdown(rows, line, plot, seconds))
    (out / "families.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"results: {out}/families.md, families.json, {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
