"""Running scenarios: context, results, tables as they complete, the results directory.

Each scenario is a function ``fn(ctx) -> ScenarioResult``. The runner times it, isolates its
failure (the traceback goes to the log and the error into the summary; the others still run),
prints its table as soon as it completes and writes ``results.json`` and ``report.md``.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tabulate import tabulate

__all__ = ["Context", "ScenarioResult", "Scenario", "run_scenarios", "format_rows"]

log = logging.getLogger("bench")


@dataclass
class Context:
    """What every scenario may use: the profile, the models, where to write, progress bars."""
    profile: str = "quick"                    # "quick" | "full"
    out_dir: Path = Path("bench/results/latest")
    lms: dict = field(default_factory=dict)   # name -> zero-arg callable returning a BenchLM
    models: tuple[str, ...] = ()              # causal LMs the training scenarios use
    # the correctness scenarios: geoscale's rewritten graphs run eagerly ("eager": the numbers
    # aot_eager gives — measured equal on scenario 7 — without its trace of every graph)
    compiler: str = "eager"
    timing_compiler: str = "inductor"         # for the timing scenarios (5, 6)
    step_scale: float = 1.0                   # tests shrink every step count
    sweep_lengths: tuple[int, ...] = ()       # tests: the sequence lengths of scenario 6
    progress: bool = True
    seed: int = 0
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def full(self) -> bool:
        return self.profile == "full"

    def pick(self, quick, full):
        return full if self.full else quick

    def steps(self, quick: int, full: int) -> int:
        """A number of steps for this profile (scaled down in tests)."""
        return max(2, round(self.pick(quick, full) * self.step_scale))

    def lm(self, name: str):
        if name not in self._cache:
            self._cache[name] = self.lms[name]()
        return self._cache[name]

    def causal_lms(self, quick_count: int = 1) -> list:
        names = self.models if self.full else self.models[:quick_count]
        return [self.lm(n) for n in names]

    def bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="step", leave=False,
                    disable=not self.progress)

    def generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + offset)


@dataclass
class ScenarioResult:
    key: str
    title: str
    rows: list[dict] = field(default_factory=list)
    paper: str = ""                 # what the paper reports for this experiment
    notes: str = ""
    plots: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)   # series behind the plots
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    fn: Callable[[Context], ScenarioResult]
    default: bool = True      # run by a plain ``python -m bench`` (else only with --only)


def format_rows(rows: list[dict], floatfmt: str = ".4g") -> str:
    if not rows:
        return "(no rows)"
    headers = list(rows[0].keys())
    for row in rows[1:]:
        headers += [k for k in row if k not in headers]
    return tabulate([[r.get(h) for h in headers] for r in rows], headers=headers,
                    floatfmt=floatfmt)


def _markdown(result: ScenarioResult) -> str:
    lines = [f"## {result.title}", ""]
    if result.error:
        lines += [f"**Failed**: `{result.error}`", ""]
    if result.rows:
        headers = list(result.rows[0].keys())
        lines.append(tabulate([[r.get(h) for h in headers] for r in result.rows],
                              headers=headers, tablefmt="github", floatfmt=".4g"))
        lines.append("")
    if result.paper:
        lines += [f"*Paper*: {result.paper}", ""]
    if result.notes:
        lines += [result.notes, ""]
    lines += [f"![{p}]({p})" for p in result.plots]
    lines.append(f"\n({result.seconds:.1f} s)\n")
    return "\n".join(lines)


def run_scenarios(scenarios: list[Scenario], ctx: Context, echo=print) -> list[ScenarioResult]:
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for scenario in scenarios:
        # every scenario starts from a fresh Dynamo (the earlier ones' models, compiled at
        # other shapes, would otherwise accumulate cache entries on shared code) and heap
        torch._dynamo.reset()
        gc.collect()
        start = time.perf_counter()
        echo(f"\n=== {scenario.title}")
        try:
            result = scenario.fn(ctx)
        except Exception as exc:  # a failing scenario is reported, the others still run
            log.error("scenario %s failed:\n%s", scenario.key, traceback.format_exc())
            result = ScenarioResult(scenario.key, scenario.title,
                                    error=f"{type(exc).__name__}: {exc}"[:500])
        result.seconds = time.perf_counter() - start
        results.append(result)
        echo(format_rows(result.rows) if result.rows else f"FAILED: {result.error}")
        if result.paper:
            echo(f"paper: {result.paper}")
        _write(results, ctx)
    summary = [{"scenario": r.title.split(" (")[0], "status": "FAILED" if r.error else "ok",
                "seconds": round(r.seconds, 1)} for r in results]
    echo("\n=== Summary\n" + format_rows(summary))
    echo(f"\nresults: {ctx.out_dir}/report.md, results.json and plots")
    return results


def _write(results: list[ScenarioResult], ctx: Context) -> None:
    payload = {"profile": ctx.profile, "torch": torch.__version__,
               "scenarios": [dataclasses.asdict(r) for r in results]}
    (ctx.out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    header = (f"# geoscale-fx benchmark ({ctx.profile} profile)\n\n"
              f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads.\n\n")
    (ctx.out_dir / "report.md").write_text(header + "\n".join(_markdown(r) for r in results))
