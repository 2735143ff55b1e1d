"""``python -m bench.export_families``: the streamed KV-scale export over every causal-LM family.

For each model type of ``hf_configs.causal_lm_types()`` a random-weight model of the shrunk
default config (``hf_configs.tiny_model``) is saved with ``save_pretrained`` to a temporary
directory, and per family:

* **streamed**: ``export_kv_scales(ckpt_dir, out, strategy="head")``, the route of
  ``geoscale export-kv-scales CKPT`` (the model traced on the meta device, only the tensors
  the bounds read streamed from the checkpoint). ``exported``: every cache layer holding
  keys and values has its scales; ``partial``: some were refused and left out
  (``KVScaleExport.left_at_default``: a serving engine runs them at its default scale, 1.0
  in vLLM), the others exported — the row counts them and gives the first refusal's
  reason; ``refused``: a ``ValueError`` raised by geoscale itself (its first line is the
  reason: no layer left, or nothing to trace); ``crashed``: any other exception (its type
  and last line);
* **in-memory**: ``export_kv_scales(from_pretrained(ckpt_dir), out, input_ids=ids)`` on the
  same checkpoint, exported or refused likewise; a streamed refusal or crash where this route
  exports is flagged (``streamed only``), and where both export, whether the two wrote the
  same scales (each within one float32 ulp of the other: both round float64 bounds of the
  same per-head math up, and float64 sums in another order can move a round-up by one ulp);
* **what the model caches**: the model itself (``from_pretrained``, eager attention) runs
  ``PROMPTS`` random prompts and an adversarial one (the token with the largest input-embedding
  norm, repeated; ``bench.families.adversarial_inputs``) with a ``DynamicCache``. Every
  ``Cache.update`` is watched: which cache layer it writes, which exported attention module
  was running when it did, and the keys and values it stored; the cache's
  ``past_key_values.layers[i].keys/values`` after the forward are read as well. Per cache
  layer and kv head, ``max |entry|`` is compared with ``scale·448`` of the module that wrote
  it (per head where the cache has as many heads as the scale; otherwise, as for an MLA
  latent cache, the whole layer's maximum against the largest scale, and the row says so).
  A layer a partial export left out is not compared (it has no scale); its writer is
  still watched, so that no other layer's entries are taken for it.
  ``violated``: an export some entry exceeds by more than ``TOLERANCE`` (relative), or a
  cache layer with entries that no exported module wrote. The range used is observed
  ``amax / (scale·448)`` over (layer, head, k/v): median and worst. The export's own report
  goes into the notes: the cache layers it wrote no scale for (a hybrid's linear-attention
  layers, named with their cache layer class) and the attentions whose cache holds a latent
  (MLA: one scale for the whole entry), and the attentions reusing another layer's cache
  (KV sharing: that layer's k/v scales). A cache layer the model wrote that has no scale is a
  violation (above: written outside any exported attention).

Each family runs under a time limit (SIGALRM) in this process, one after the other; a
family's failure of any kind is a row, never the end of the sweep. Output: a table, a
summary line, and ``export_families.md`` / ``export_families.json`` in ``--out``::

    python -m bench.export_families                        # every family (20-40 min)
    python -m bench.export_families --families llama gemma3 gptj
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import tempfile
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from tabulate import tabulate

from bench.families import (_FamilyTimeout, _last_line, _quiet, _short, _time_limit,
                            adversarial_inputs)

__all__ = ["family_row", "checkpoint_row", "cached_amax", "compare_with_cache", "summary",
           "main"]

log = logging.getLogger("bench")

TOLERANCE = 1e-5       # violated: observed > scale · 448 · (1 + TOLERANCE)
R_MAX = 448.0          # E4M3
PROMPTS = 3
SEQ_LEN = 32
IN_MEMORY_LEN = 8


def _empty_row(model_type: str) -> dict:
    return {"family": model_type, "streamed": None, "in-memory": None, "streamed only": False,
            "same scales": None, "layers": None, "left at 1.0": None, "checks": None,
            "violations": None, "range median": None, "range worst": None, "notes": "",
            "seconds": None, "reason": "", "in-memory reason": ""}


def _outcome(exc: BaseException) -> tuple[str, str]:
    """``("refused", reason)`` for a ``ValueError`` that geoscale raised (the innermost frame
    is in ``geoscale_fx``), else ``("crashed", "Type: last line")``."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = bool(frames) and "geoscale_fx" in Path(frames[-1].filename).parts
    if isinstance(exc, ValueError) and ours:
        return "refused", str(exc).strip().splitlines()[0]
    return "crashed", f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    """The first line of an error that says something (Dynamo's first line says which node
    failed and how; its boilerplate lines are skipped)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()
             and not ln.startswith(("Set TORCHDYNAMO_VERBOSE", "from user code"))]
    return lines[0] if lines else _last_line(exc)


#: the outcomes of an export that wrote scales
WROTE = ("exported", "partial")


def _export(target, out: Path, **kwargs):
    """``(outcome, reason, KVScaleExport | None)`` of one ``export_kv_scales`` call:
    ``partial`` with the first left-out layer's refusal when some were left out."""
    from geoscale_fx.export.kv_scales import export_kv_scales

    try:
        export = export_kv_scales(target, out, strategy="head", **kwargs)
        left = list(export.left_at_default.values())
        if left:
            first = left[0]
            return "partial", (f"{len(left)} left at 1.0, first {first.layer} "
                               f"(`{first.site}`): {first.reason}"), export
        return "exported", "", export
    except _FamilyTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 — a family's failure is a row
        if "_FamilyTimeout" in str(exc):
            raise
        log.debug("export of %s:\n%s", target, traceback.format_exc())
        return (*_outcome(exc), None)


@contextmanager
def _watch_cache_updates(model: torch.nn.Module, sites: list[str]):
    """Records every ``Cache.update(keys, values, layer_idx)`` as ``(layer_idx, site, keys
    amax per head, values amax per head)``: ``site`` is the exported site that the innermost
    running module holding exactly one of ``sites`` (itself or below it) holds — the module
    that wrote the cache, whether the site is it (``self_attn``) or one of its parts
    (CPM-Ant's ``softmax``) — or None if no running module holds one."""
    from transformers.cache_utils import Cache

    running: list[str] = []
    records: list[tuple] = []
    original = Cache.update

    def writer() -> str | None:
        for name in reversed(running):
            held = [s for s in sites if s == name or s.startswith(f"{name}.") or not name]
            if held:
                return held[0] if len(held) == 1 else None
        return None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        records.append((layer_idx, writer(), _head_amax(key_states), _head_amax(value_states)))
        return original(self, key_states, value_states, layer_idx, *args, **kwargs)

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, name=name: running.append(name)))
        handles.append(module.register_forward_hook(lambda m, a, o: running.pop() and None))
    Cache.update = update
    try:
        yield records
    finally:
        Cache.update = original
        for h in handles:
            h.remove()


def _head_amax(x) -> torch.Tensor | None:
    """``max |entry|`` per head (axis 1) of ``(B, H, L, d)``, float64; None if no entries."""
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return None
    x = x.detach().double().abs()
    if x.dim() < 3:
        return x.amax().reshape(1)
    return x.transpose(0, 1).reshape(x.shape[1], -1).amax(-1)


def _forward_with_cache(model, ids: torch.Tensor):
    """One forward on ``ids (B, T)`` with a ``DynamicCache`` (the model's own cache where
    it refuses one); the cache it filled."""
    import warnings

    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
        with warnings.catch_warnings():      # 5.x renames it ``cache``; not every model yet
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated")
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    except Exception as exc:  # noqa: BLE001 — then the model's own cache class
        if isinstance(exc, _FamilyTimeout):
            raise
        out = model(input_ids=ids, use_cache=True)
    return getattr(out, "past_key_values", None)


@torch.no_grad()
def cached_amax(model, sites: list[str], prompts: list[torch.Tensor]
                ) -> tuple[dict[int, dict], list[str]]:
    """Per cache layer, over ``prompts``: ``{"sites": the modules that wrote it, "k": amax
    per head, "v": amax per head}`` from the watched updates and the cache's layers after
    each forward (whichever is larger); and notes (a layer no module wrote)."""
    layers: dict[int, dict] = {}
    notes = []

    def merge(index: int, site, k, v) -> None:
        entry = layers.setdefault(index, {"sites": set(), "k": None, "v": None})
        if site is not None:
            entry["sites"].add(site)
        for kind, value in (("k", k), ("v", v)):
            if value is None:
                continue
            old = entry[kind]
            if old is not None and old.shape != value.shape:   # heads differ: whole layer
                old, value = old.max().reshape(1), value.max().reshape(1)
            entry[kind] = value if old is None else torch.maximum(old, value)

    for ids in prompts:
        with _watch_cache_updates(model, sites) as records:
            cache = _forward_with_cache(model, ids)
        for index, site, k, v in records:
            merge(index, site, k, v)
        for index, layer in enumerate(getattr(cache, "layers", None) or []):
            merge(index, None, _head_amax(getattr(layer, "keys", None)),
                  _head_amax(getattr(layer, "values", None)))
    if not layers:
        notes.append("no cache layer was written")
    return layers, notes


def compare_with_cache(scales: dict[str, torch.Tensor], layers: dict[int, dict]
                       ) -> tuple[list[float], int, list[str]]:
    """``(observed / (scale·448) per comparison, violations, notes)``; ``scales`` as
    exported (``<site>.k_scale``: ``(n_kv, 1, 1)``)."""
    ratios, violations, notes = [], 0, []
    for index, entry in sorted(layers.items()):
        if entry["k"] is None and entry["v"] is None:
            continue
        if not entry["sites"]:
            notes.append(f"cache layer {index} written outside any exported attention")
            violations += 1
            continue
        for site in sorted(entry["sites"]):
            for kind in ("k", "v"):
                observed = entry[kind]
                if observed is None:
                    continue
                limit = scales[f"{site}.{kind}_scale"].double().reshape(-1) * R_MAX
                if limit.numel() != observed.numel():
                    notes.append(f"layer {index} {kind}: cache has {observed.numel()} heads, "
                                 f"scales {limit.numel()}: compared whole-layer max")
                    observed, limit = observed.max().reshape(1), limit.max().reshape(1)
                for o, s in zip(observed.tolist(), limit.tolist()):
                    ratios.append(o / s)
                    if o > s * (1 + TOLERANCE):
                        violations += 1
                        notes.append(f"layer {index} {kind}: {o:.4g} > scale·448 = {s:.4g}")
    return ratios, violations, notes


def _prompts(model) -> list[torch.Tensor]:
    """``PROMPTS`` random prompts ``(1, SEQ_LEN)`` and the adversarial one."""
    from geoscale_fx.testing.hf_configs import token_inputs

    ids = token_inputs(model, batch=PROMPTS, seq_len=SEQ_LEN)["input_ids"]     # (P, T)
    adversarial = adversarial_inputs(model, {"input_ids": ids[:1]})["input_ids"]
    return [*ids.split(1), adversarial]


def _same_scales(a, b) -> bool:
    """The same names and dtypes, each value within one ulp of the other's (module doc)."""
    def near(x: torch.Tensor, y: torch.Tensor) -> bool:
        up, down = (torch.nextafter(y, torch.full_like(y, v))
                    for v in (float("inf"), float("-inf")))
        return x.dtype == y.dtype and x.shape == y.shape and bool(((x >= down) & (x <= up)).all())

    return a.tensors.keys() == b.tensors.keys() and all(
        near(a.tensors[n], t) for n, t in b.tensors.items())


def _load(ckpt: Path, **kwargs):
    """``from_pretrained`` with the class the streamed route builds (``causal_lm_class``)."""
    from transformers import AutoConfig

    from geoscale_fx.testing.hf_configs import causal_lm_class

    cls = causal_lm_class(AutoConfig.from_pretrained(ckpt))
    return cls.from_pretrained(ckpt, **kwargs).eval()


def _check_cache(row: dict, ckpt: Path, export) -> None:
    """Fill the cache columns of ``row`` from the model loaded from ``ckpt``; the layers a
    partial export left out are watched (their writers named) but not compared."""
    model = _load(ckpt, attn_implementation="eager")
    sites = sorted({n.rsplit(".", 1)[0] for n in export.tensors})
    left = {r.layer: r.site for r in export.left_at_default.values()}
    watched = sorted({*sites, *left.values()})
    layers, notes = cached_amax(model, watched, _prompts(model))
    layers = {i: entry for i, entry in layers.items() if i not in left}
    ratios, violations, more = compare_with_cache(export.tensors, layers)
    row.update({"layers": len(sites), "left at 1.0": len(left), "checks": len(ratios),
                "violations": violations,
                "range median": statistics.median(ratios) if ratios else None,
                "range worst": max(ratios) if ratios else None})
    row["notes"] = "; ".join(dict.fromkeys(notes + more + _export_notes(export)))
    if violations:
        row["streamed"] = "violated"


def _export_notes(export) -> list[str]:
    """The export's report: cache layers holding no keys and values, those left at 1.0 and
    why (a partial export), latent caches and KV sharing."""
    notes = []
    if export.left_at_default:
        notes.append("left at 1.0 (refused): " + "; ".join(
            f"{layer} (`{r.site}`: {_short(r.reason, 80)})"
            for layer, r in export.left_at_default.items()))
    if export.not_cached:
        notes.append("no scale for cache layers " + ", ".join(
            f"{i} ({why.split(':')[0]})" for i, why in sorted(export.not_cached.items())))
    if export.latent:
        notes.append(f"latent cache (one k/v scale, no q_scale): {len(export.latent)} "
                     "attention(s)")
    if export.shared:
        notes.append("k/v scales of the cache layer they reuse: " + ", ".join(
            f"{name} → {layer}"
            for name, layer in export.shared.items()))
    return notes


def _run_family(row: dict, model_type: str, work: Path) -> None:
    from geoscale_fx.testing import hf_configs

    try:
        model = hf_configs.tiny_model(model_type)
    except ValueError as exc:
        row["streamed"], row["reason"] = "not built", str(exc).splitlines()[0]
        return
    ckpt = work / "ckpt"
    model.save_pretrained(ckpt)
    del model
    checkpoint_row(row, ckpt, work)


def checkpoint_row(row: dict, ckpt: Path, work: Path) -> None:
    """Fill ``row`` from the saved checkpoint ``ckpt``: both routes' exports, compared with
    each other and with what the model caches (see the module docstring)."""
    from geoscale_fx.testing import hf_configs

    row["streamed"], row["reason"], streamed = _export(ckpt, work / "streamed")
    row["reason"] = row["reason"].replace(str(ckpt), "CKPT")
    loaded = _load(ckpt)
    ids = hf_configs.token_inputs(loaded, seq_len=IN_MEMORY_LEN)["input_ids"]
    row["in-memory"], row["in-memory reason"], in_memory = _export(
        loaded, work / "in-memory", input_ids=ids)
    del loaded
    row["streamed only"] = row["streamed"] not in WROTE and row["in-memory"] in WROTE
    if streamed is not None and in_memory is not None:
        row["same scales"] = _same_scales(streamed, in_memory) and \
            streamed.left_at_default.keys() == in_memory.left_at_default.keys()
    if streamed is not None:
        _check_cache(row, ckpt, streamed)


def family_row(model_type: str, timeout: int = 180) -> dict:
    """One row for transformers ``model_type`` (see the module docstring); a failure or a
    timeout of the sweep's own steps (saving, loading, the cache check) is recorded as
    ``streamed="error"`` with its reason, never raised."""
    row = _empty_row(model_type)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"export-{model_type}-") as work:
        try:
            with _time_limit(timeout):
                _run_family(row, model_type, Path(work))
        except Exception as exc:  # noqa: BLE001 — any failure of a family is a row
            timed_out = isinstance(exc, _FamilyTimeout) or "_FamilyTimeout" in str(exc)
            row["notes"] = "; ".join(filter(None, [row["notes"], (
                f"timeout: over the {timeout} s limit" if timed_out
                else f"sweep step failed: {type(exc).__name__}: {_last_line(exc)}")]))
            if row["streamed"] in (None, *WROTE):
                row["streamed"] = "error"
            log.debug("%s:\n%s", model_type, traceback.format_exc())
        finally:
            torch._dynamo.reset()
            gc.collect()
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def summary(rows: list[dict]) -> dict:
    """Counts of the streamed outcomes, the cache layers partial exports left at 1.0,
    streamed-only refusals, and scale mismatches."""
    counts = Counter(r["streamed"] for r in rows)
    return {"families": len(rows), **{k: counts.get(k, 0) for k in (
        "exported", "partial", "violated", "refused", "crashed", "error", "not built")},
            "left at 1.0": sum(r["left at 1.0"] or 0 for r in rows),
            "streamed only": sum(r["streamed only"] for r in rows),
            "scales differ": sum(r["same scales"] is False for r in rows),
            "in-memory exported": sum(r["in-memory"] in WROTE for r in rows)}


def _summary_line(s: dict) -> str:
    return (f"{s['families']} families: streamed export {s['exported']} exported and "
            f"certified, {s['partial']} partial (certified, {s['left at 1.0']} cache layers "
            f"left at 1.0), {s['violated']} violated, {s['refused']} refused, {s['crashed']} "
            f"crashed, {s['error']} sweep errors, {s['not built']} not built; "
            f"{s['streamed only']} refused or crashed where the in-memory route exports "
            f"({s['in-memory exported']} exported in memory, whole or partial); "
            f"{s['scales differ']} with scales differing from the in-memory route's")


def _fmt(x) -> str | None:
    return None if x is None else f"{x:.3g}"


def _table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        reason = r["reason"] or r["notes"]
        if r["streamed only"]:
            reason = "[in memory: exported] " + reason
        out.append({"family": r["family"], "streamed": r["streamed"],
                    "in-memory": r["in-memory"],
                    "same": {True: "yes", False: "NO", None: None}[r["same scales"]],
                    "layers": r["layers"], "left 1.0": r["left at 1.0"] or None,
                    "checks": r["checks"],
                    "viol.": r["violations"], "range med": _fmt(r["range median"]),
                    "range worst": _fmt(r["range worst"]), "s": r["seconds"],
                    "reason / notes": _short(reason, 110)})
    return out


def _grouped(rows: list[dict], outcome: str) -> list[tuple[str, list[str]]]:
    """Streamed reasons of ``outcome`` -> families, most frequent first."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r["streamed"] == outcome:
            key = r["reason"] or r["notes"]
            groups.setdefault(_short(key, 200), []).append(r["family"])
    return sorted(groups.items(), key=lambda kv: -len(kv[1]))


def _markdown(rows: list[dict], line: str, seconds: float) -> str:
    table = tabulate(_table_rows(rows), headers="keys", tablefmt="github", missingval="")
    parts = [f"# The streamed KV-scale export over transformers' causal-LM families\n\n"
             f"torch {torch.__version__}, strategy=\"head\", {PROMPTS} random prompts and an "
             f"adversarial one of {SEQ_LEN} tokens, {seconds:.0f} s in all.\n\n"
             f"**Summary**: {line}\n\n{table}\n"]
    for outcome in ("partial", "refused", "crashed", "error"):
        groups = _grouped(rows, outcome)
        if groups:
            parts.append(f"\n## {outcome.capitalize()}, by reason\n\n" + "\n".join(
                f"* {len(f)}× {reason}: {', '.join(f)}" for reason, f in groups) + "\n")
    noted = [r for r in rows if r["notes"]]
    if noted:
        parts.append("\n## Notes\n\n" + "\n".join(f"* `{r['family']}`: {r['notes']}"
                                                  for r in noted) + "\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    from geoscale_fx.testing.hf_configs import causal_lm_types

    parser = argparse.ArgumentParser(prog="python -m bench.export_families", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", metavar="TYPE", help="these model types only")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per family")
    parser.add_argument("--out", type=Path, help="results directory "
                        "(default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    _quiet()
    log.setLevel(logging.INFO)
    types = args.families or sorted(causal_lm_types())
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    for n, model_type in enumerate(types, 1):
        row = family_row(model_type, args.timeout)
        rows.append(row)
        log.info("[%d/%d] %s: %s (in memory: %s) %.1f s %s", n, len(types), model_type,
                 row["streamed"], row["in-memory"], row["seconds"],
                 _short(row["reason"] or row["notes"], 100))
    seconds = time.perf_counter() - start
    line = _summary_line(summary(rows))
    print(tabulate(_table_rows(rows), headers="keys", missingval=""))
    for outcome in ("partial", "refused", "crashed", "error"):
        for reason, families in _grouped(rows, outcome):
            print(f"{outcome} {len(families)}× {reason}: {', '.join(families)}")
    print(f"\n{line}\n{seconds:.0f} s in all")
    (out / "export_families.md").write_text(_markdown(rows, line, seconds))
    (out / "export_families.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"results: {out}/export_families.md, export_families.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
