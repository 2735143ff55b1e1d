"""bench/host_overhead.py on a tiny run: both programs measured, and every replayed decode
step of ``geometry`` on the runtime's fast path (a StaticCache written in place each call:
the record's versions are read again after it, so the next call still holds)."""
from __future__ import annotations

import pytest

from bench import host_overhead

pytestmark = pytest.mark.zoo


def test_a_tiny_run_times_both_programs_and_replays_on_the_fast_path():
    pytest.importorskip("transformers")
    rows = host_overhead.run(["--programs", "none", "geometry", "--context", "32",
                              "--calls", "20", "--steps", "3", "--rounds", "2",
                              "--compiler", "eager"])
    by_program = {r["program"]: r for r in rows}
    assert sorted(by_program) == ["geometry", "none"]
    assert by_program["geometry"]["slow calls in replay"] == 0
    assert by_program["geometry"]["slow calls in steps"] == 0
    assert by_program["none"]["slow calls in replay"] == 40    # no variant to reuse
    assert by_program["none"]["slow calls in steps"] == 6
    for row in rows:
        assert 0 < row["replay min"] <= row["replay µs/call (median)"]
        assert 0 < row["steps min"] <= row["steps host µs (median)"]
