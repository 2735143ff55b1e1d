"""Running scenarios: context, results, tables as they complete, the results directory.

Each scenario is a function ``fn(ctx) -> ScenarioResult``. The runner times it, isolates its
failure (the traceback goes to the log and the error into the summary; the others still run),
prints its table as soon as it completes and writes ``results.json`` and ``report.md`` (in the
scenarios' order).

With ``jobs > 1`` the scenarios that time nothing run first, ``jobs`` at a time, each in a
spawned process of its own (a fresh interpreter: their compiles are single-threaded Python,
so on two cores two of them take little longer than one); the timed ones (``Scenario.timed``)
run after them in this process, one at a time, on the machine the others have left idle.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import multiprocessing
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tabulate import tabulate

__all__ = ["Context", "ScenarioResult", "Scenario", "run_scenarios", "format_rows",
           "quiet_libraries"]

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

    def __getstate__(self):   # sent to a scenario process: the models are built there
        return {**self.__dict__, "_cache": {}}


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
    timed: bool = False       # measures time: runs alone, after the others, in the main process


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


def quiet_libraries(level: int = logging.WARNING) -> None:
    """The benchmark's logging: ``name: message`` at ``level``; transformers' weight-loading
    progress bars off (they would drown the tables)."""
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    try:
        import transformers
    except ImportError:
        return
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def run_scenario(scenario: Scenario, ctx: Context) -> ScenarioResult:
    """One scenario, timed, from a fresh Dynamo and heap; its failure becomes its result."""
    # every scenario starts from a fresh Dynamo (the earlier ones' models, compiled at
    # other shapes, would otherwise accumulate cache entries on shared code) and heap
    torch._dynamo.reset()
    gc.collect()
    start = time.perf_counter()
    try:
        result = scenario.fn(ctx)
    except Exception as exc:  # a failing scenario is reported, the others still run
        log.error("scenario %s failed:\n%s", scenario.key, traceback.format_exc())
        result = ScenarioResult(scenario.key, scenario.title,
                                error=f"{type(exc).__name__}: {exc}"[:500])
    result.seconds = time.perf_counter() - start
    return result


def run_scenarios(scenarios: list[Scenario], ctx: Context, echo=print,
                  jobs: int = 1) -> list[ScenarioResult]:
    """Run ``scenarios``; with ``jobs > 1`` the untimed ones ``jobs`` at a time in processes
    of their own first, then the timed ones here. Returns the results in the given order."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    done: dict[str, ScenarioResult] = {}

    def finish(scenario: Scenario, result: ScenarioResult) -> None:
        done[scenario.key] = result
        echo(format_rows(result.rows) if result.rows else f"FAILED: {result.error}")
        if result.paper:
            echo(f"paper: {result.paper}")
        _write([done[s.key] for s in scenarios if s.key in done], ctx)

    untimed = [s for s in scenarios if not s.timed]
    here = scenarios
    if jobs > 1 and len(untimed) > 1:
        _run_in_processes(untimed, ctx, min(jobs, len(untimed)), echo, finish)
        here = [s for s in scenarios if s.timed]
        if here:
            echo(f"\nthe timed scenarios, one at a time: {', '.join(s.key for s in here)}")
    for scenario in here:
        echo(f"\n=== {scenario.title}")
        finish(scenario, run_scenario(scenario, ctx))
    results = [done[s.key] for s in scenarios]
    summary = [{"scenario": r.title.split(" (")[0], "status": "FAILED" if r.error else "ok",
                "seconds": round(r.seconds, 1)} for r in results]
    echo("\n=== Summary\n" + format_rows(summary))
    if jobs > 1 and len(untimed) > 1:
        echo(f"(the untimed scenarios' seconds are {min(jobs, len(untimed))} at a time, "
             "each in its own process)")
    echo(f"\nresults: {ctx.out_dir}/report.md, results.json and plots")
    return results


def _start_scenario_process(threads: int, level: int) -> None:
    quiet_libraries(level)
    torch.set_num_threads(threads)


def _run_in_processes(scenarios: list[Scenario], ctx: Context, jobs: int, echo,
                      finish: Callable[[Scenario, ScenarioResult], None]) -> None:
    """``scenarios`` ``jobs`` at a time, each in a spawned process sharing this one's
    threads; tables print as each completes."""
    from tqdm.auto import tqdm

    threads = max(1, torch.get_num_threads() // jobs)
    echo(f"\nthe untimed scenarios, {jobs} at a time in processes of their own "
         f"({threads} thread{'s' if threads > 1 else ''} each): "
         f"{', '.join(s.key for s in scenarios)}")
    quiet = dataclasses.replace(ctx, progress=False)   # one bar here instead of one per process
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_scenario_process,
                               initargs=(threads, logging.getLogger().getEffectiveLevel()))
    try:
        with tqdm(total=len(scenarios), desc="untimed scenarios", unit="scenario",
                  leave=False, disable=not ctx.progress) as bar:
            running = {pool.submit(run_scenario, s, quiet): s for s in scenarios}
            for future in as_completed(running):
                scenario = running[future]
                try:
                    result = future.result()
                except Exception as exc:  # the process died (a crash, the OOM killer)
                    log.error("scenario %s: its process failed: %s", scenario.key, exc)
                    result = ScenarioResult(scenario.key, scenario.title,
                                            error=f"{type(exc).__name__}: {exc}"[:500])
                bar.update()
                echo(f"\n=== {scenario.title}")
                finish(scenario, result)
    except BaseException:   # Ctrl-C here: the scenarios still running would run to their end
        _stop(pool)
        raise
    pool.shutdown()


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel the scenarios not started and end the processes running the others now
    (before Python 3.14's ``terminate_workers`` the executor's processes are only reachable
    through its ``_processes``)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=10)


def _write(results: list[ScenarioResult], ctx: Context) -> None:
    payload = {"profile": ctx.profile, "torch": torch.__version__,
               "scenarios": [dataclasses.asdict(r) for r in results]}
    (ctx.out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    header = (f"# geoscale-fx benchmark ({ctx.profile} profile)\n\n"
              f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads.\n\n")
    (ctx.out_dir / "report.md").write_text(header + "\n".join(_markdown(r) for r in results))
