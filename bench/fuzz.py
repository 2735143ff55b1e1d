"""Fuzzing the attention analysis with random blocks (``tests/fuzz_forms.py``).

Draws ``--examples`` random attention blocks from the hypothesis strategy
``tests.fuzz_forms.forms()`` (seeded: the same ``--seed`` draws the same blocks) and runs
``check_example`` on each: the site found (or refused with a reason), the certified logit and
q/k/v amax bounds against adversarial inputs with gains ×4, ``scaling="none"`` against eager,
and geometry with ``audit=True`` for overflows. Prints, per surface form, how many blocks
used it, how many were supported or refused (top reasons), and every failure count; writes
``bench/results/<timestamp>/fuzz.md`` (with each failing block in full) and ``fuzz.json``.

Run ``python -m bench.fuzz --examples 5000 [--seed N] [--jobs 2]``.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing
import re
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tabulate import tabulate
from tqdm import tqdm

log = logging.getLogger("bench.fuzz")

#: result counters shown per feature: column -> predicate on a result dict
FAILURES = {
    "violations": lambda r: bool(r["violations"]),
    "silent misses": lambda r: r["silent_miss"],
    "unexpected": lambda r: bool(r["mismatch"]),
    "none≠eager": lambda r: r["none_equals_eager"] is False,
    "overflows": lambda r: bool(r["overflows"]),
    "errors": lambda r: bool(r["error"]),
    "v unbounded": lambda r: bool(r["gap"]),      # a gap, not a failure (``ok`` ignores it)
}


def _check(form, steps: int, audit: bool) -> dict:
    from tests.fuzz_forms import check_example

    return check_example(form, steps=steps, audit=audit).as_dict()


def _quiet() -> None:
    """A worker's set-up: errors only (the table says what failed), one thread each."""
    import torch

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("geoscale_fx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)


def _reason_key(reason: str) -> str:
    """A refusal reason with graph node names (backticked) and node kinds elided."""
    return re.sub(r"\s*\([a-z_]+\)", "", re.sub(r"`[^`]*`", "·", reason)).strip()[:70]


def feature_rows(results: list[dict]) -> list[dict]:
    """One row per ``name=value`` feature (and ``all``), sorted by feature."""
    groups = collections.defaultdict(list)
    for r in results:
        groups["all"].append(r)
        for feature in r["features"]:
            groups[feature].append(r)
    rows = []
    for feature in ["all"] + sorted(k for k in groups if k != "all"):
        rs = groups[feature]
        reasons = collections.Counter(_reason_key(r["reason"]) for r in rs
                                      if r["supported"] is False)
        row = {"feature": feature, "generated": len(rs),
               "supported": sum(r["supported"] is True for r in rs),
               "refused": sum(r["supported"] is False for r in rs),
               "of them measured": sum(r.get("measured") is True for r in rs),
               "top refusal reasons": "; ".join(f"{k} ×{n}" for k, n in reasons.most_common(2))}
        row.update({name: sum(bool(test(r)) for r in rs) for name, test in FAILURES.items()})
        row["worst logit ratio"] = max((r["worst"].get("logits", 0.0) for r in rs), default=0.0)
        rows.append(row)
    return rows


def _failures(results: list[dict]) -> str:
    lines = []
    for r in results:
        if r["ok"]:
            continue
        what = [name for name, test in FAILURES.items() if test(r)]
        detail = r["mismatch"] or r["error"] or "; ".join(r["violations"]) or \
            f"none max diff / max|y| {r['none_max_diff']:.3g}, overflows {r['overflows']}"
        lines.append(f"* **{', '.join(what)}**: {detail}  (reason: {r['reason'] or '-'})\n"
                     f"  `{r['form']}`")
    return "\n".join(lines) or "(none)"


def _markdown(rows, results, args, seconds) -> str:
    import torch

    table = tabulate(rows, headers="keys", tablefmt="github", floatfmt=".3f")
    return (f"# Fuzzing the analysis with random attention blocks\n\ntorch {torch.__version__}, "
            f"{len(results)} examples, seed {args.seed}, {args.steps} ascent steps, audit "
            f"{not args.no_audit}, {args.jobs} job(s), {seconds:.0f} s in all.\n\n{table}\n\n"
            f"## Failing examples\n\n{_failures(results)}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the draw")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--steps", type=int, default=12, help="gradient-ascent steps")
    parser.add_argument("--no-audit", action="store_true", help="skip the audit=True run")
    parser.add_argument("--out", type=Path, help="results directory "
                        "(default bench/results/<timestamp>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    from tests.fuzz_forms import draw_forms

    forms = draw_forms(args.examples, args.seed)
    log.info("drew %d forms (seed %d) in %.1f s", len(forms), args.seed,
             time.perf_counter() - start)
    results = []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_quiet) as pool:
        done = pool.map(_check, forms, [args.steps] * len(forms),
                        [not args.no_audit] * len(forms))
        for r in tqdm(done, total=len(forms), desc="fuzz", unit="block"):
            results.append(r)
    seconds = time.perf_counter() - start
    rows = feature_rows(results)
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    failed = sum(not r["ok"] for r in results)
    print(f"\n{len(results)} examples, {failed} failing, {seconds:.0f} s in all "
          f"({seconds / max(len(results), 1):.2f} s per example with {args.jobs} job(s))")
    (out / "fuzz.md").write_text(_markdown(rows, results, args, seconds))
    (out / "fuzz.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {out}/fuzz.md, fuzz.json")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
