"""bench/fold_rounding.py on two blocks: every head counted, and no q/k/v entry bound or scale
under its float64 value (the float64 fold of ``numerics.amax``)."""
from __future__ import annotations

from bench import fold_rounding


def test_entry_bounds_and_scales_are_never_under_the_float64_ones():
    rows = {r["bound"]: r for r in fold_rounding.measure(2)}
    assert {name: r["heads"] for name, r in rows.items()} == {
        "logit": 8, "q/k/v entry": 24, "scale B/448": 24}         # 4 heads, q/k/v, 2 blocks
    for name in ("q/k/v entry", "scale B/448"):
        assert rows[name]["below float64"] == 0
        assert rows[name]["largest shortfall (relative)"] == "none"
