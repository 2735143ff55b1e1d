"""Check ``suite``: the suite's CUDA tests — those a ``skipif`` guards on CUDA — and their counts.

The tests are found by reading ``tests/`` (a test function, or a module's ``pytestmark``,
whose ``skipif`` condition mentions ``cuda``), so a new guarded test joins the check without
an edit here. They run in a pytest subprocess (``-o addopts=``: the project's options name
pytest-xdist, which a bare machine lacks) with a JUnit XML report, under the check's remaining
time. Without pytest the row says so: the tests import it.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.gpu.harness import CheckContext

__all__ = ["cuda_tests", "junit_counts", "check_suite"]

ROOT = Path(__file__).resolve().parents[2]


def _guards_cuda(decorator: ast.expr) -> bool:
    """``@pytest.mark.skipif(<condition naming cuda>, ...)``."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "skipif" and decorator.args):
        return False
    return "cuda" in ast.unparse(decorator.args[0])


def _module_guarded(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) \
                else [node.value]
            if any(_guards_cuda(m) for m in marks):
                return True
    return False


def cuda_tests(tests_dir: Path = ROOT / "tests") -> list[str]:
    """Node ids (``tests/x.py::test_y``, relative to the repository) of the guarded tests."""
    found = []
    for path in sorted(tests_dir.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        whole = _module_guarded(tree)
        rel = path.relative_to(tests_dir.parent).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.name.startswith("test") and \
                    (whole or any(_guards_cuda(d) for d in node.decorator_list)):
                found.append(f"{rel}::{node.name}")
    return found


def junit_counts(xml_path: Path) -> dict:
    """``{"passed", "failed", "errors", "skipped"}`` and the messages of what did not pass."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    messages = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(child.tag)
            if kind:
                outcome = kind
                text = (child.get("message") or child.text or "").strip().splitlines()
                messages.append(f"{case.get('name')}: {outcome}: {text[0] if text else ''}")
        counts[outcome] += 1
    return {**counts, "messages": messages}


def _run_pytest(ctx: CheckContext, ids: list[str]) -> dict:
    xml = Path(ctx.setting.scratch) / "cuda-tests.xml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    timeout = max(10.0, ctx.limit_s - ctx.elapsed())
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=",
                           "-p", "no:cacheprovider", f"--junitxml={xml}", *ids],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if not xml.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"pytest wrote no report (exit {done.returncode}): "
                           + " / ".join(tail))
    return junit_counts(xml)


def check_suite(ctx: CheckContext) -> None:
    ids = ctx.run("find the guarded tests", 1, cuda_tests)
    if ids is None:
        return
    ctx.figure("CUDA tests found", len(ids))
    ctx.note("tests: " + ", ".join(ids))
    if importlib.util.find_spec("pytest") is None:
        ctx.skip("run them", "not run: pytest is not installed here (the tests import it); "
                 "the fp8_qkv row runs the same kernel comparison")
        return
    # pytest, torch and transformers start and the test modules import (~20 s), then the
    # tests themselves (today one small FA3 call)
    counts = ctx.run("run them", 24, lambda: _run_pytest(ctx, ids))
    if counts is None:
        return
    for key in ("passed", "failed", "errors", "skipped"):
        ctx.figure(key, counts[key])
    ctx.notes.extend(counts["messages"])
