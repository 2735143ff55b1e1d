"""``python -m bench.gpu``: the GPU check's harness, and its rehearsal on this CPU machine.

The rehearsal (``slow``) runs the whole command in-process with no CUDA device, as on this
machine, and checks its rows: every CUDA verdict is "not run: no CUDA device" (never a pass),
no piece of any check failed (the code the GPU machine will run works here at tiny shapes),
and every figure is a finite number, with the values that can be known in advance (the FP8
cache is half of BF16's bytes; every scale exported equals ``attention_scales``'s). The
harness tests (fast) check the time limit between pieces, a failing piece, the budget, the
discovery of the suite's CUDA tests and the JUnit counts.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch

from bench.gpu import suite_tests
from bench.gpu.__main__ import main
from bench.gpu.checks import BUDGET_S, CHECKS
from bench.gpu.harness import NO_CUDA, TINY, Check, Setting, run_check
from bench.gpu.report import _stand_in_tabulate, markdown_table

KEYS = [c.key for c in CHECKS]


def _run_main(argv: list[str]) -> tuple[str, dict, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    folder = Path(argv[argv.index("--out") + 1])
    (run_dir,) = folder.glob("gpu-*")
    results = json.loads((run_dir / "results.json").read_text())
    return out.getvalue(), results, (run_dir / "report.md").read_text()


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the rehearsal is the run without one")
    return _run_main(["--device", "cpu", "--out", str(tmp_path_factory.mktemp("gpu"))])


@pytest.mark.slow
def test_every_cuda_row_is_not_run_and_no_piece_failed(rehearsal):
    stdout, results, report = rehearsal
    rows = {r["check"]: r for r in results["rows"]}
    assert list(rows) == KEYS
    assert {r["cuda"] for r in rows.values()} == {NO_CUDA}
    failed = [(r["check"], p["piece"], p["status"]) for r in rows.values() for p in r["pieces"]
              if p["status"] != "ran" and not p["status"].startswith("not run")]
    assert failed == []
    assert all(not r["status"].startswith(("failed", "stopped")) for r in rows.values())
    assert results["versions"]["GPU"] == "none" and stdout.startswith("python: ")
    assert "torch: " + torch.__version__ in stdout
    # the report's summary: one line per check, its CUDA cell "not run", never "ran"
    summary = [line for line in report.splitlines() if line.startswith(tuple(
        f"| {k} |" for k in KEYS))]
    assert len(summary) == len(KEYS) and all(f"| {NO_CUDA} |" in line for line in summary)


@pytest.mark.slow
def test_every_rehearsal_figure_is_present_and_finite(rehearsal):
    rows = {r["check"]: r for r in rehearsal[1]["rows"]}
    for key, row in rows.items():
        assert row["figures"], key
        assert all(math.isfinite(v) for v in row["figures"].values()), (key, row["figures"])
    tag = f"b{TINY.batches[0]} l{TINY.lengths[0]}"
    suite, qkv, flex = rows["suite"]["figures"], rows["fp8_qkv"]["figures"], rows["flex"]["figures"]
    assert suite["CUDA tests found"] >= 1 and suite["passed"] == 0
    assert suite["skipped"] == suite["CUDA tests found"]
    assert 0 < qkv["emulation rel L2 vs fp32"] < 0.2 and qkv["overflow steps"] == 0
    assert qkv["sites fp8_qkv"] == 1 and qkv["sites on FA3"] == 0     # a one-layer model
    assert flex[f"FP8 flex rel L2 vs fp32 {tag}"] > flex[f"plain flex rel L2 vs fp32 {tag}"]
    assert flex["model overflow steps"] == 0 and flex["model sites certified"] == 1
    kv = rows["kv_cache"]["figures"]
    assert kv[f"fp8 / bf16 cache bytes {tag}"] == 0.5
    assert kv["saturated FP8 cache entries (so far)"] == 0
    assert 0 <= kv[f"teacher-forced top-1 {tag}"] <= 1
    assert rows["sigma"]["figures"]["sites bounded"] == TINY.layers
    export = rows["export"]["figures"]
    assert export["scales"] == 3 * TINY.layers == export["scales finite and > 0"]
    assert export["exported == attention_scales"] == export["scales"]


# ---- the harness --------------------------------------------------------------------------

def _setting(tmp_path) -> Setting:
    return Setting(device="cpu", shapes=TINY, compiler="eager", scratch=str(tmp_path))


def test_the_time_limit_stops_a_check_between_pieces(tmp_path):
    """Each piece takes 10 s of a fake clock; the limit is 15 s: the second piece runs (it
    started at 10 s), the third does not, and the row says so with the pieces done."""
    now = [0.0]

    def check(ctx):
        for name in ("one", "two", "three"):
            ctx.run(name, 1, lambda: now.__setitem__(0, now[0] + 10))
            ctx.figure(f"{name} done", 1)
    row = run_check(Check("c", "t", "p", check, 15, 3), _setting(tmp_path), 15,
                    clock=lambda: now[0])
    assert row.status.startswith("stopped at its time limit (15 s) after 20.0 s")
    assert "before 'three'" in row.status and "pieces done: one, two" in row.status
    assert [p["piece"] for p in row.pieces] == ["one", "two"]
    assert row.figures == {"one done": 1.0, "two done": 1.0}
    assert row.cuda == NO_CUDA


def test_a_failing_piece_is_recorded_and_the_check_goes_on(tmp_path):
    def check(ctx):
        ctx.run("broken", 1, lambda: 1 / 0)
        ctx.skip("absent", "not run: nothing to run it on")
        ctx.figure("after", ctx.run("fine", 1, lambda: 7))
    row = run_check(Check("c", "t", "p", check, 60, 2), _setting(tmp_path), 60)
    assert [p["status"] for p in row.pieces] == [
        "failed: ZeroDivisionError: division by zero", "not run: nothing to run it on", "ran"]
    assert row.status.startswith("ran 1 of 3 pieces; broken: failed: ZeroDivisionError")
    assert row.figures == {"after": 7.0} and "ZeroDivisionError" in row.notes[0]


def test_a_spent_budget_leaves_the_checks_not_run(tmp_path):
    stdout, results, report = _run_main(["--device", "cpu", "--budget", "0", "--out",
                                         str(tmp_path)])
    assert [r["check"] for r in results["rows"]] == KEYS
    assert {r["status"] for r in results["rows"]} == {"not run: the run's budget (0 s) was spent"}
    assert {r["cuda"] for r in results["rows"]} == {NO_CUDA}
    assert "GPU: none" in stdout and report.count(NO_CUDA) == len(KEYS)


def test_the_limits_fit_the_budget_and_the_estimates_fit_the_limits():
    assert sum(c.limit_s for c in CHECKS) <= BUDGET_S <= 8 * 60 - 30
    assert all(0 < c.estimate_s < c.limit_s for c in CHECKS)


def test_the_docs_table_states_each_check_s_limit_and_estimate():
    text = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    for c in CHECKS:
        (line,) = [l for l in text.splitlines() if l.startswith(f"| `{c.key}` |")]
        assert line.endswith(f"| {c.limit_s:g} ({c.estimate_s:g}) |"), line[-30:]


def test_cuda_tests_are_found_by_their_skipif_guard(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "import pytest, torch, sys\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')\n"
        "def test_kernel(): pass\n"
        "@pytest.mark.skipif(sys.platform == 'win32', reason='not on Windows')\n"
        "def test_other(): pass\n"
        "def test_plain(): pass\n")
    (tests / "test_b.py").write_text(
        "import pytest, torch\n"
        "pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA')]\n"
        "def test_one(): pass\n"
        "def helper(): pass\n")
    assert suite_tests.cuda_tests(tests) == ["tests/test_a.py::test_kernel",
                                             "tests/test_b.py::test_one"]
    assert "tests/test_fp8_qkv.py::test_fa3_kernel_matches_the_emulation" in \
        suite_tests.cuda_tests()


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="4">'
        '<testcase name="a"/>'
        '<testcase name="b"><failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase name="c"><skipped message="needs a CUDA device"/></testcase>'
        '<testcase name="d"><error message="fixture broke"/></testcase>'
        '</testsuite></testsuites>')
    counts = suite_tests.junit_counts(xml)
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == \
        {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert counts["messages"] == ["b: failed: assert 1 == 2", "c: skipped: needs a CUDA device",
                                  "d: errors: fixture broke"]


def test_the_table_writers():
    assert markdown_table([[1, "a|b"], [0.123456, None]], ["x", "y"]).splitlines() == [
        "| x | y |", "|---|---|", "| 1 | a\\|b |", "| 0.1235 |  |"]
    # the stand-in for tabulate (absent on the GPU machine) takes the library's two spellings
    assert _stand_in_tabulate([{"site": "s", "bound": 2.0}], headers="keys").splitlines()[2] \
        == "| s | 2 |"
    assert _stand_in_tabulate([["s", 2.0]], headers=["site", "bound"]).splitlines()[0] == \
        "| site | bound |"
