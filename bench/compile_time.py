"""Compile time against plain Inductor: ``python -m bench.compile_time`` (issue 19, item 4).

The goal: geometry's compile time ≤ 1.5 × plain's for a forward and a training step, ≤ 2 ×
for decode. Measured here as the **first call** (compile + run) of each step, for the
programs of ``bench.profile_step`` (its ``_model``: the zoo's small GPT-2/Llama shapes,
random weights, the same inputs):

* ``plain``    — ``model.compile(backend="inductor")``;
* ``none``     — ``geoscale_fx.apply_(model, scaling="none")``: geoscale's lowering and
  runtime, no bound, no FP8 (``none / plain`` is the kernel's share, e.g. the fused CPU
  flex_attention template; ``geometry / none`` geoscale's own); only when asked for;
* ``geometry`` — ``geoscale_fx.apply_(model)``, the default scaling;
* ``current``  — ``geoscale_fx.apply_(model, scaling="current")``, for reference.

Steps: ``forward`` (no grad, no cache), ``train`` (forward, backward, AdamW) and ``decode``,
which has two phases: the prefill of a StaticCache with ``context // 2`` tokens, then one
greedy decode step at position ``context // 2`` (each compiles its own graph, as in
``generate``). ``setup s`` is the model's construction and ``apply_``/``compile`` (lazy:
nothing is traced before the first call).

Every measurement is a fresh process (``--child PROGRAM STEP``: no Dynamo or Inductor state
in memory), in two cache states:

* ``cold`` — a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``):
  everything compiled from scratch;
* ``warm`` — a second process on the directory the cold one filled: a user's second launch,
  where Inductor's FX graph cache and AOTAutograd's cache can hit. Their counters
  (``torch._dynamo.utils.counters``: ``fxgraph_cache_hit/miss/bypass``,
  ``autograd_cache_hit/miss/bypass``) are reported per phase, and why a graph bypassed a
  cache (their log lines) under the table.

Inductor's compiler is imported before anything is timed, by every program
(``import_s`` in the JSON): ``torch.compile`` imports it at set-up, geoscale at its first
compile, so the first call would otherwise count ~0.4–0.6 s of imports for geoscale that
plain Inductor paid in its set-up (measured: a warm geometry forward's first call 2.99 s →
2.59 s with the import done before, plain's 1.81 s → 1.83 s).

Each phase starts after a full garbage collection (``gc.collect()``), as ``timeit`` keeps
the collector out of what it times: otherwise a phase pays for a full collection of every
object the set-up and the earlier phases left (0.27 s in a decode phase, measured), or not,
by where the collector's thresholds happen to fall. The collector's seconds inside each
phase are still counted in its time, and reported (``gc_s`` in the JSON).

Rounds interleave the programs (``bench.timing.interleaved``: the order rotates from round
to round, a round being one cold and one warm process per program); a program's ratio to
plain is taken within each round and reported as the median with its min–max spread over
rounds, flagged ``undecided`` where the spread crosses the goal (``bench.timing.spread_flag``).
The first call is timed twice: wall time (what a user waits) and CPU seconds of the process,
of its compile workers and of the C++ compilers they ran (``/proc``): on a shared machine
other processes' load stretches the first, barely the second.
``bench/results/<timestamp>/`` gets ``compile_time.md`` and ``compile_time.json``.

    python -m bench.compile_time                         # gpt2 shape, every step, 3 rounds
    python -m bench.compile_time --family llama --steps decode --rounds 5
    python -m bench.compile_time --child geometry forward    # one measurement: a JSON line
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from tabulate import tabulate

from bench.profile_step import SHAPES, _config, _model
from bench.timing import Timings, interleaved, spread_flag

__all__ = ["main", "run", "first_calls", "measure", "table_rows", "PROGRAMS", "STEPS"]

PROGRAMS = ("plain", "none", "geometry", "current")
STEPS = ("forward", "train", "decode")
#: each measured phase: its step, and the goal on its ratio to plain (issue 19, item 4)
PHASES = {"forward": ("forward", 1.5), "train": ("train", 1.5),
          "prefill": ("decode", 2.0), "decode": ("decode", 2.0)}
CACHES = ("cold", "warm")
#: (group, name) in ``torch._dynamo.utils.counters``, shown as hit/miss/bypass
CACHE_COUNTERS = {"fx graph cache": ("inductor", "fxgraph_cache"),
                  "aot autograd cache": ("aot_autograd", "autograd_cache"),
                  "geoscale graph cache": ("geoscale", "graph_cache")}
_OUTCOMES = ("hit", "miss", "bypass")
_BYPASS_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")
_ROOT = Path(__file__).resolve().parents[1]


# --- the child: one program, one step, in this process -------------------------------------

def _phases(config, program: str, step: str, batch: int, length: int,
            context: int) -> list[tuple[str, Callable[[], object]]]:
    """The calls of ``step`` in order, as ``bench.profile_step`` makes them (not yet run)."""
    model = _model(config, program, training=step == "train")
    if step == "forward":
        ids = torch.randint(0, config.vocab_size, (batch, length))
        return [("forward", lambda: _no_grad(model, input_ids=ids, use_cache=False))]
    if step == "train":
        ids = torch.randint(0, config.vocab_size, (batch, length))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def train():
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
        return [("train", train)]
    from transformers import StaticCache

    prompt = context // 2
    ids = torch.randint(0, config.vocab_size, (batch, prompt))
    cache = StaticCache(config=config, max_cache_len=context)
    return [("prefill", lambda: _no_grad(model, input_ids=ids, past_key_values=cache,
                                         use_cache=True, cache_position=torch.arange(prompt))),
            ("decode", lambda: _no_grad(model, input_ids=ids[:, -1:], past_key_values=cache,
                                        use_cache=True,
                                        cache_position=torch.tensor([prompt])))]


def _no_grad(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _cache_counts() -> dict[str, list[int]]:
    from torch._dynamo.utils import counters

    return {label: [counters[group][f"{name}_{o}"] for o in _OUTCOMES]
            for label, (group, name) in CACHE_COUNTERS.items()}


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its live descendants (Inductor's compile workers),
    each with the children it has waited for (the C++ compiler), from ``/proc``: what other
    processes' load on a shared machine barely moves, unlike the wall clock."""
    parents, cpu = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # the name may hold spaces
        except (OSError, IndexError):
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(map(int, fields[11:15]))     # utime stime cutime cstime
    family, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in family} - family
        family, grew = family | more, bool(more)
    return sum(cpu.get(pid, 0) for pid in family) / os.sysconf("SC_CLK_TCK")


class _Collector:
    """Seconds the cyclic garbage collector ran inside the ``with`` block."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self):
        self.seconds = 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


class _Reasons(logging.Handler):
    """Why a graph bypassed a cache: the caches' own INFO lines, each reason once."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Bypassing") and message not in self.seen:
            self.seen.append(message)


def first_calls(program: str, step: str, family: str = "gpt2", batch: int = 1,
                length: int = 128, context: int = 256, layers: int | None = None) -> dict:
    """Seconds of each phase's first call (and of the set-up) in this process, with the
    cache counters each phase moved. Meaningful once per process: Dynamo's state stays."""
    torch._dynamo.config.automatic_dynamic_shapes = False    # each shape its static graph
    reasons = _Reasons()
    for name in _BYPASS_LOGGERS:
        logging.getLogger(name).addHandler(reasons)
        logging.getLogger(name).setLevel(logging.INFO)
    config = _config(family, context if step == "decode" else max(context, length))
    if layers is not None:     # a shallower model, for tests
        config.num_hidden_layers = layers
    start = time.perf_counter()
    importlib.import_module("torch._inductor.compile_fx")    # see the module docstring
    import_s, start = time.perf_counter() - start, time.perf_counter()
    phases = _phases(config, program, step, batch, length, context)
    out = {"program": program, "step": step, "setup_s": time.perf_counter() - start,
           "import_s": import_s, "phases": {}}
    collector = _Collector()
    for name, call in phases:
        gc.collect()     # no phase pays for the garbage of the one before (module docstring)
        before, cpu, start = _cache_counts(), _cpu_seconds(), time.perf_counter()
        with collector:
            call()
        seconds, cpu, after = (time.perf_counter() - start, _cpu_seconds() - cpu,
                               _cache_counts())
        out["phases"][name] = {"seconds": seconds, "cpu_s": cpu, "gc_s": collector.seconds,
                               "counters": {k: [a - b for a, b in zip(after[k], before[k])]
                                            for k in after}}
    out["bypass_reasons"] = reasons.seen
    return out


# --- the parent: fresh processes, interleaved rounds ---------------------------------------

def measure(program: str, step: str, cache_dir: Path, args: argparse.Namespace) -> dict:
    """``first_calls`` in a fresh process whose Inductor (and Triton) cache is ``cache_dir``;
    ``process_s`` adds the interpreter's start and the imports."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
           "TRITON_CACHE_DIR": str(cache_dir / "triton"),
           "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "bench.compile_time", "--child", program, step,
               "--family", args.family, "--batch", str(args.batch),
               "--length", str(args.length), "--context", str(args.context)]
    if args.layers is not None:
        command += ["--layers", str(args.layers)]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=_ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{program} {step} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def _cold_then_warm(program: str, step: str, args, work: Path, record: list) -> None:
    cache_dir = Path(tempfile.mkdtemp(prefix=f"{program}-{step}-", dir=work))
    try:
        for cache in CACHES:
            record.append({"cache": cache, "round": len(record) // len(CACHES),
                           **measure(program, step, cache_dir, args)})
            print(f"  {step} {program} {cache}: " + ", ".join(
                f"{n} {p['seconds']:.2f} s" for n, p in record[-1]["phases"].items()),
                flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def rounds_of(step: str, args, work: Path) -> list[dict]:
    """Every child's result for ``step``: ``args.rounds`` interleaved rounds, each running
    every program cold, then warm on the cache its cold run filled."""
    record: dict[str, list] = {p: [] for p in args.programs}
    fns = {p: (lambda p=p: _cold_then_warm(p, step, args, work, record[p]))
           for p in args.programs}
    interleaved(fns, base="plain", rounds=args.rounds, repeats=1, warmup=0)
    return [r for p in args.programs for r in record[p]]


# --- the table -----------------------------------------------------------------------------

def _counts(results: list[dict], phase: str, label: str) -> str:
    """hit/miss/bypass of one cache in one phase; several values when rounds differ."""
    seen = sorted({"/".join(map(str, r["phases"][phase]["counters"][label]))
                   for r in results})
    return ", ".join(seen)


def _timings(runs: dict[str, list[dict]], phase: str, key: str) -> Timings:
    return Timings({p: [r["phases"][phase][key] for r in rs] for p, rs in runs.items()},
                   base="plain", clock="cpu" if key == "cpu_s" else "wall")


def table_rows(results: list[dict], programs: list[str]) -> list[dict]:
    """One row per (phase, cache state, program): the median first-call seconds, the ratio
    to plain (median over rounds, [min–max]), its goal and whether it is met; the same
    ratio in CPU seconds, which the shared machine's load barely moves."""
    rows = []
    phases = [p for p in PHASES if any(p in r["phases"] for r in results)]
    for phase in phases:
        step, goal = PHASES[phase]
        for cache in CACHES:
            runs = {p: [r for r in results if r["cache"] == cache and r["program"] == p
                        and phase in r["phases"]] for p in programs}
            wall, cpu = _timings(runs, phase, "seconds"), _timings(runs, phase, "cpu_s")
            for program in programs:
                stat, cpu_stat = wall.ratio(program), cpu.ratio(program)
                compared = program != "plain"
                rows.append({
                    "step": step, "phase": phase, "cache": cache, "program": program,
                    "first call s": statistics.median(wall.seconds[program]),
                    "ratio to plain": stat.median, "spread": f"{stat.lo:.2f}–{stat.hi:.2f}",
                    "goal": goal if compared else None,
                    "verdict": spread_flag(stat, goal, higher_is_better=False)
                    if compared else "",
                    "cpu s": statistics.median(cpu.seconds[program]),
                    "cpu ratio": f"{cpu_stat.median:.2f} [{cpu_stat.lo:.2f}–{cpu_stat.hi:.2f}]",
                    "cpu verdict": spread_flag(cpu_stat, goal, higher_is_better=False)
                    if compared else "",
                    "setup s": statistics.median(r["setup_s"] for r in runs[program]),
                    **{f"{label} h/m/b": _counts(runs[program], phase, label)
                       for label in CACHE_COUNTERS}})
    return rows


def _markdown(rows: list[dict], results: list[dict], args, seconds: float,
              load: tuple) -> str:
    reasons = sorted({(r["program"], r["step"], m) for r in results
                      for m in r["bypass_reasons"]})
    listed = "\n".join(f"* `{p}` {s}: {m}" for p, s, m in reasons) or "(none)"
    return (f"# Compile time: first calls against plain Inductor\n\n"
            f"`python -m bench.compile_time {' '.join(args.argv)}`\n\n"
            f"torch {torch.__version__}, {args.family} shape, batch {args.batch}, length "
            f"{args.length}, decode context {args.context}, {args.rounds} interleaved rounds, "
            f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the start and "
            f"{load[1]:.1f} at the end, {seconds:.0f} s in all.\n\n"
            + tabulate(rows, headers="keys", tablefmt="github", floatfmt=".3g",
                       missingval="") +
            f"\n\n## Cache bypasses (the caches' own reasons)\n\n{listed}\n")


def run(argv: list[str] | None = None) -> list[dict]:
    """Measure, print and write the table; returns its rows (``main`` runs this)."""
    args = _parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if "plain" not in args.programs:
        raise SystemExit("--programs: the ratios are to plain; include plain")
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    start, load = time.perf_counter(), os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="compile_time-") as work:
        for step in args.steps:
            results += rounds_of(step, args, Path(work))
    seconds = time.perf_counter() - start
    rows = table_rows(results, args.programs)
    print()
    print(tabulate(rows, headers="keys", floatfmt=".3g", missingval=""))
    (out / "compile_time.md").write_text(
        _markdown(rows, results, args, seconds, (load, os.getloadavg()[0])))
    (out / "compile_time.json").write_text(json.dumps(
        {"argv": args.argv, "torch": torch.__version__, "seconds": seconds,
         "rows": rows, "results": results}, indent=1, default=str))
    print(f"\nresults: {out}/compile_time.md, compile_time.json")
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.compile_time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS,
                        default=["plain", "geometry", "current"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--family", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=128, help="tokens of forward/train")
    parser.add_argument("--context", type=int, default=256, help="decode's cache length")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's 4 (tests)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per process")
    parser.add_argument("--out", type=Path, help="results directory "
                        "(default bench/results/<timestamp>)")
    parser.add_argument("--child", nargs=2, metavar=("PROGRAM", "STEP"),
                        help="measure one program's step in this process: a JSON line")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.child is None:
        run(argv)
        return 0
    program, step = args.child
    if program not in PROGRAMS or step not in STEPS:
        raise SystemExit(f"--child {program} {step}: PROGRAM is one of {list(PROGRAMS)}, "
                         f"STEP one of {list(STEPS)}")
    print(json.dumps(first_calls(program, step, args.family, args.batch, args.length,
                                 args.context, args.layers)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
