"""``python -m bench``: the model-zoo benchmark (quick profile by default, ≤ 10 min on 2 cores).

    python -m bench                       # quick profile, every default scenario
    python -m bench --only distributed    # 13: 2 processes (gloo), TP and FSDP2
    python -m bench --full                # more models and steps
    python -m bench --only overhead seq-len
    python -m bench --models pretrained-llama

Tables print as each scenario completes; ``bench/results/<timestamp>/`` gets results.json,
report.md and the PNG plots. A failing scenario is reported and the others still run.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from bench.runner import Context, run_scenarios


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
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:  # weight-loading progress bars of transformers would drown the tables
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:
        pass
    profile = "full" if args.full else "quick"
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S")
    ctx = Context(
        profile=profile, out_dir=out,
        lms={"pretrained-gpt2": lambda: lms.pretrained_lm("gpt2", profile),
             "pretrained-llama": lambda: lms.pretrained_lm("llama", profile),
             "minilm": lms.minilm_lm},
        models=tuple(args.models or ("pretrained-gpt2", "pretrained-llama")),
        progress=not args.no_progress)
    chosen = [s for s in SCENARIOS if (s.key in args.only if args.only else s.default)]
    start = time.perf_counter()
    results = run_scenarios(chosen, ctx)
    print(f"total {time.perf_counter() - start:.0f} s ({profile} profile)")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
