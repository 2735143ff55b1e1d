"""bench/certified_cost.py's scales table on a tiny run (eager, one round): every route
timed at the zoo's layer, each share positive, the certified routes' bounds computed."""
from __future__ import annotations

from bench import certified_cost


def test_the_scales_table_times_every_route_against_the_layer_step():
    rows = certified_cost.scale_table(["zoo"], tokens=64, rounds=1, repeats=1,
                                      backend="eager")
    assert [r["route"] for r in rows] == list(certified_cost.ROUTES)
    layers = certified_cost.SCALES["zoo"][0]
    for row in rows:
        assert row["layers"] == layers
        assert 0 < row["share of a step"] < 10
        assert row["bound ms / step"] == layers * row["bound ms / layer"] > 0
        assert row["step ms (64 tokens)"] > 0
