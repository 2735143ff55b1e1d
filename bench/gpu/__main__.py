"""``python -m bench.gpu`` (see the package docstring)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu import models
from bench.gpu.checks import BUDGET_S, CHECKS
from bench.gpu.harness import LLAMA3_8B, TINY, Row, Setting, run_check
from bench.gpu.report import ensure_tabulate, format_value, versions, write_results

ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                        help="the folder that gets gpu-<timestamp>/ (default bench/results)")
    parser.add_argument("--checks", nargs="+", choices=[c.key for c in CHECKS],
                        default=[c.key for c in CHECKS])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: CUDA when a device is there, else the CPU rehearsal")
    parser.add_argument("--tiny", action="store_true",
                        help="the rehearsal's tiny shapes on CUDA too (a smoke run)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for all checks (default {BUDGET_S:g}); each check gets "
                             "its own limit, never more than what is left")
    return parser


def _setting(args, scratch: str) -> Setting:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m bench.gpu: --device cuda, but torch sees no CUDA device")
    shapes = TINY if device == "cpu" or args.tiny else LLAMA3_8B
    return Setting(device=device, shapes=shapes, scratch=scratch,
                   compiler="inductor" if device == "cuda" else "aot_eager")


def _line(row: Row) -> str:
    figures = ", ".join(f"{k} {format_value(v)}" for k, v in list(row.figures.items())[:6])
    more = len(row.figures) - 6
    return (f"[{row.check}] CUDA: {row.cuda} | this run: {row.status} | {row.seconds:.1f} s "
            f"of {row.limit_s:g} ({row.cpu_s:.1f} s CPU) | {figures}"
            f"{f' (+{more} more)' if more > 0 else ''}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    log = logging.getLogger("geoscale_fx")
    level = log.level
    log.setLevel(logging.ERROR)    # the fallbacks' warnings are the rows' business here
    try:
        return _run(args, argv)
    finally:
        log.setLevel(level)


def _run(args, argv: list[str] | None) -> int:
    started = time.perf_counter()
    tabulate_state = ensure_tabulate()
    header = {**versions(ROOT), "tabulate": tabulate_state}
    out_dir = args.out / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}"
    for key, value in header.items():
        print(f"{key}: {value}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as scratch:
        setting = _setting(args, scratch)
        run = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": args.budget,
               "command": "python -m bench.gpu " + " ".join(argv if argv is not None
                                                          else sys.argv[1:]),
               "device": setting.device, "shapes": setting.shapes.name,
               "compiler": setting.compiler, "seconds": 0.0}
        print(f"device {setting.device}, shapes {setting.shapes.name}, compiler "
              f"{setting.compiler}; results in {out_dir}", flush=True)
        budget_end = time.perf_counter() + args.budget
        for check in (c for c in CHECKS if c.key in args.checks):
            left = budget_end - time.perf_counter()
            if left <= 0:
                row = Row(check.key, check.title, check.proves, setting.device,
                          status=f"not run: the run's budget ({args.budget:g} s) was spent",
                          limit_s=0.0, estimate_s=check.estimate_s)
                if setting.cuda:
                    row.cuda = row.status
            else:
                row = run_check(check, setting, min(check.limit_s, left))
            print(_line(row), flush=True)
            rows.append(row.as_dict())
            run["seconds"] = time.perf_counter() - started
            write_results(out_dir, header, rows, run)
        models.release()
    print(f"wrote {out_dir / 'report.md'} and results.json ({run['seconds']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
