"""The run's header (versions found), its tables, and ``report.md`` / ``results.json``.

The GPU machine has torch, Triton, transformers and accelerate, and nothing that is not one of
their dependencies: no ``tabulate`` (a dependency of geoscale_fx, whose ``report()`` prints
with it) and possibly no pytest. ``ensure_tabulate`` puts a plain table writer in its place
when it is missing (and says so in the header), so the checks reach the library's code; the
bench's own tables never need it (``markdown_table``).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import platform
import subprocess
import sys
import types
from pathlib import Path

import torch

__all__ = ["versions", "ensure_tabulate", "markdown_table", "write_results", "format_value"]

#: the modules whose presence the header states (what the checks may need)
OPTIONAL = ("triton", "transformers", "accelerate", "safetensors", "pytest", "xdist",
            "tabulate", "flash_attn_interface")


def _version(module: str) -> str:
    if module not in sys.modules and importlib.util.find_spec(module) is None:
        return "absent"
    try:
        return str(getattr(importlib.import_module(module), "__version__", "present"))
    except Exception as exc:         # present but broken: the header says how
        return f"present, fails to import ({type(exc).__name__})"


def _git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if out.returncode != 0:
        return "unknown (not a git checkout)"
    return out.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")


def versions(root: Path) -> dict:
    """What this machine runs: torch and its CUDA, the GPU, the optional modules, the tree."""
    found = {"python": platform.python_version(), "torch": torch.__version__,
             "torch CUDA": torch.version.cuda or "none (CPU build)",
             "CUDA available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update({"GPU": torch.cuda.get_device_name(0),
                      "compute capability": f"{props.major}.{props.minor}",
                      "GPU memory GiB": round(props.total_memory / 2 ** 30, 1),
                      "GPUs": torch.cuda.device_count()})
    else:
        found["GPU"] = "none"
    found.update({m: _version(m) for m in OPTIONAL})
    found["geoscale-fx commit"] = _git_commit(root)
    found["platform"] = f"{platform.system()} {platform.machine()}"
    return found


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def markdown_table(rows: list, headers) -> str:
    """A GitHub table of ``rows`` (lists, or dicts with ``headers="keys"``); ``|`` escaped."""
    if headers == "keys":
        headers = list(rows[0]) if rows else []
        rows = [[r.get(h) for h in headers] for r in rows]

    def cell(v) -> str:
        return format_value(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _stand_in_tabulate(rows, headers=(), **_ignored) -> str:
    rows = list(rows)
    if headers != "keys" and rows and isinstance(rows[0], dict):
        rows = [list(r.values()) for r in rows]
    return markdown_table(rows, headers if headers else [""] * len(rows[0] if rows else []))


def ensure_tabulate() -> str:
    """``tabulate``'s state here; when absent, a plain writer is registered under its name."""
    if importlib.util.find_spec("tabulate") is not None:
        return "installed"
    module = types.ModuleType("tabulate")
    module.__spec__ = importlib.machinery.ModuleSpec("tabulate", None)
    module.tabulate = _stand_in_tabulate
    module.__version__ = "bench.gpu stand-in"
    sys.modules["tabulate"] = module
    return "absent: bench.gpu's plain table writer stands in (report() tables)"


#: figures a row of the summary table shows (all of them are in the check's own section)
SHOWN = 6


def _figures_cell(row: dict) -> str:
    items = list(row["figures"].items())
    more = f" (+{len(items) - SHOWN} below)" if len(items) > SHOWN else ""
    return "; ".join(f"{k} {format_value(v)}" for k, v in items[:SHOWN]) + more or "—"


def _report_md(header: dict, rows: list[dict], run: dict) -> str:
    cuda = header.get("CUDA available")
    where = ("CUDA figures, at the shapes named" if cuda else
             "**no CUDA device: every CUDA row is not run**; the figures are the CPU "
             "rehearsal's, at tiny shapes — they prove the code runs, nothing about a GPU")
    lines = [f"# python -m bench.gpu — {run['started']}", "",
             f"Command: `{run['command']}`. {where}. Whole run {run['seconds']:.1f} s "
             f"(budget {run['budget_s']:g} s).", "",
             markdown_table([[k, v] for k, v in header.items()], ["found", "version"]), "",
             markdown_table([[r["check"], r["title"], r["cuda"], _figures_cell(r),
                              f"{r['seconds']:.1f} / {r['limit_s']:g} "
                              f"(est. {r['estimate_s']:g}; CPU {r.get('cpu_s', 0):.1f})"]
                             for r in rows],
                            ["check", "what", "CUDA", "figures (" + rows[0]["device"] + ")"
                             if rows else "figures", "s / limit (H200 est.; process CPU s)"]), ""]
    for r in rows:
        lines += [f"## {r['check']}: {r['title']}", "", r["proves"], "",
                  f"This run ({r['device']}): {r['status']}", "",
                  markdown_table([[p["piece"], p["status"], p["seconds"], p["estimate_s"]]
                                  for p in r["pieces"]],
                                 ["piece", "status", "s", "H200 est. s"]), ""]
        if r["figures"]:
            lines += [markdown_table(list(r["figures"].items()), ["figure", "value"]), ""]
        if r["notes"]:
            lines += ["Notes:", ""] + [f"    {line}" for n in r["notes"]
                                       for line in str(n).splitlines()] + [""]
    return "\n".join(lines)


def write_results(out_dir: Path, header: dict, rows: list[dict], run: dict) -> None:
    """``results.json`` (header, run, rows) and ``report.md``, rewritten after every check so
    that a run cut short still leaves what it measured."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        {"versions": header, "run": run, "rows": rows}, indent=1, default=str))
    (out_dir / "report.md").write_text(_report_md(header, rows, run))
