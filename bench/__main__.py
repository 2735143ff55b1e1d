"""``python -m bench``: the model-zoo benchmark (quick profile by default, ≤ 10 min on 2 cores).

    python -m bench                       # quick profile, every default scenario
    python -m bench --only distributed    # 13: 2 processes (gloo), TP and FSDP2
    python -m bench --full                # more models and steps
    python -m bench --only overhead seq-len
    python -m bench --models pretrained-llama
    python -m bench --jobs 1              # every scenario in this process, one at a time

The scenarios that time nothing run first, two at a time (``--jobs``), each in a process of
its own; the timed ones (5, 6, 11, 13, 14) after them, alone. Tables print as each scenario
completes; ``bench/results/<timestamp>/`` gets results.json,
report.md and the PNG plots. A failing scenario is reported and the others still run.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

from bench.runner import Context, quiet_libraries, run_scenarios


def main(argv: list[str] | None = None) -> int:
    from bench import lms, memory

    memory.supported()  # fix malloc's mmap threshold before anything large is allocated
    from bench.scenarios import SCENARIOS

    keys = [s.key for s in SCENARIOS]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the full profile")
    parser.add_argument("--only", nargs="+", choices=keys, metavar="SCENARIO",
                        help=f"run only these scenarios: {', '.join(keys)}")
    parser.add_argument("--models", nargs="+", choices=["pretrained-gpt2", "pretrained-llama"],
                        help="causal LMs for the training scenarios")
    parser.add_argument("--out", type=Path, help="results directory "
                        "(default bench/results/<timestamp>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="scenarios that time nothing run this many at a time, each in a "
                             "process of its own, before the timed ones (default: 2, or 1 on "
                             "one core; 1: all in this process)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, not {args.jobs}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet_libraries()
    profile = "full" if args.full else "quick"
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S")
    ctx = Context(
        profile=profile, out_dir=out,
        lms={"pretrained-gpt2": functools.partial(lms.pretrained_lm, "gpt2", profile),
             "pretrained-llama": functools.partial(lms.pretrained_lm, "llama", profile),
             "minilm": lms.minilm_lm},     # callables a scenario process can receive
        models=tuple(args.models or ("pretrained-gpt2", "pretrained-llama")),
        progress=not args.no_progress)
    chosen = [s for s in SCENARIOS if (s.key in args.only if args.only else s.default)]
    start = time.perf_counter()
    results = run_scenarios(chosen, ctx, jobs=args.jobs)
    print(f"total {time.perf_counter() - start:.0f} s ({profile} profile)")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
