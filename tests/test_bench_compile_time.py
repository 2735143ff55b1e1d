"""bench/compile_time.py: the table from the children's results (ratios within a round, the
goal flag), and one real run — fresh processes, the JSON line each prints, and a warm process
that reads the compiled graph back from the cache its cold twin filled."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from bench import compile_time


def _result(program, cache, seconds, counters=(1, 0, 0)):
    return {"program": program, "step": "forward", "cache": cache, "setup_s": 1.0,
            "phases": {"forward": {"seconds": seconds, "cpu_s": seconds / 2, "counters": {
                label: list(counters) for label in compile_time.CACHE_COUNTERS}}},
            "bypass_reasons": []}


def test_rows_take_the_ratio_within_each_round_and_flag_the_goal():
    # two rounds; cold: geometry 2× then 3× plain (misses 1.5), warm: 1.0× and 2.0× (crosses)
    results = [_result("plain", "cold", 10.0), _result("plain", "warm", 2.0),
               _result("plain", "cold", 20.0), _result("plain", "warm", 1.0),
               _result("geometry", "cold", 20.0), _result("geometry", "warm", 2.0),
               _result("geometry", "cold", 60.0, (0, 1, 0)), _result("geometry", "warm", 2.0)]
    rows = compile_time.table_rows(results, ["plain", "geometry"])
    by_key = {(r["cache"], r["program"]): r for r in rows}
    assert sorted(by_key) == [("cold", "geometry"), ("cold", "plain"),
                              ("warm", "geometry"), ("warm", "plain")]
    cold = by_key["cold", "geometry"]
    assert cold["ratio to plain"] == pytest.approx(2.5)      # median of 2 and 3
    assert (cold["spread"], cold["goal"], cold["verdict"]) == ("2.00–3.00", 1.5, "misses")
    assert cold["first call s"] == pytest.approx(40.0)
    assert cold["fx graph cache h/m/b"] == "0/1/0, 1/0/0"     # the rounds differ: both shown
    assert (cold["cpu s"], cold["cpu ratio"], cold["cpu verdict"]) == (
        pytest.approx(20.0), "2.50 [2.00–3.00]", "misses")
    warm = by_key["warm", "geometry"]
    assert (warm["ratio to plain"], warm["verdict"]) == (pytest.approx(1.5), "undecided")
    assert by_key["cold", "plain"]["ratio to plain"] == 1.0
    assert by_key["cold", "plain"]["verdict"] == ""


def test_cpu_seconds_count_this_process_and_the_children_it_waited_for():
    start = compile_time._cpu_seconds()
    subprocess.run([sys.executable, "-c",
                    "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.5: pass"], check=True)
    child = compile_time._cpu_seconds() - start
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    assert child >= 0.5 - 0.02                       # clock ticks are 10 ms
    assert compile_time._cpu_seconds() - start >= child + 0.3 - 0.02


def test_options_that_cannot_be_measured_are_refused():
    with pytest.raises(SystemExit, match="include plain"):
        compile_time.run(["--programs", "geometry"])
    with pytest.raises(SystemExit, match="PROGRAM is one of"):
        compile_time.main(["--child", "eager", "forward"])


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.zoo
def test_a_tiny_run_compiles_cold_then_reads_the_cache_warm(tmp_path):
    pytest.importorskip("transformers")
    rows = compile_time.run(["--steps", "forward", "--programs", "plain", "--rounds", "1",
                             "--layers", "1", "--length", "16", "--out", str(tmp_path)])
    assert [(r["phase"], r["cache"], r["program"]) for r in rows] == [
        ("forward", "cold", "plain"), ("forward", "warm", "plain")]
    cold, warm = rows
    assert cold["fx graph cache h/m/b"] == "0/1/0"     # compiled from scratch
    assert warm["fx graph cache h/m/b"] == "1/0/0"     # read back, nothing compiled
    assert warm["aot autograd cache h/m/b"] == "1/0/0"
    for row in rows:
        assert math.isfinite(row["first call s"]) and row["first call s"] > 0
        assert 0 < row["cpu s"] < 10 * row["first call s"]
        assert row["ratio to plain"] == 1.0
    assert warm["first call s"] < cold["first call s"]
    saved = json.loads((tmp_path / "compile_time.json").read_text())
    assert [(r["program"], r["cache"], r["round"]) for r in saved["results"]] == [
        ("plain", "cold", 0), ("plain", "warm", 0)]
    assert all(r["process_s"] > r["phases"]["forward"]["seconds"] for r in saved["results"])
    assert "| forward" in (tmp_path / "compile_time.md").read_text()


def test_the_collector_counts_the_garbage_collections_inside_its_block():
    import gc

    # young-generation collections: the callbacks fire for every generation, and a full
    # collection of a test worker's heap takes seconds
    collector = compile_time._Collector()
    with collector:
        gc.collect(0)
    inside = collector.seconds
    gc.collect(0)            # outside the block: not counted
    assert inside > 0 and collector.seconds == inside
    assert collector._callback not in gc.callbacks
