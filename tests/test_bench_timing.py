"""bench/timing.py: interleaved rounds, ratios within a round, the goal flag."""
from __future__ import annotations

import pytest

from bench import timing
from bench.timing import RatioStat, Timings, interleaved, spread_flag


def test_rounds_rotate_the_order_and_warm_up_each_method():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    interleaved(fns, base="a", rounds=3, repeats=1, warmup=1)
    # each method: one warm-up and one timed call per round; the first method rotates
    rounds = [calls[i:i + 6] for i in range(0, 18, 6)]
    assert [r[0] for r in rounds] == ["a", "b", "c"]
    assert all(sorted(r) == ["a", "a", "b", "b", "c", "c"] for r in rounds)


def test_ratios_are_taken_within_each_round(monkeypatch):
    """A load drift that slows every method of a round cancels in that round's ratio."""
    clock = iter([0.0, 1.0, 1.0, 3.0,           # round 0: a 1 s, b 2 s
                  3.0, 13.0, 13.0, 23.0])       # round 1 (order b, a): b 10 s, a 10 s
    monkeypatch.setitem(timing.CLOCKS, "wall", lambda: next(clock))
    t = interleaved({"a": lambda: None, "b": lambda: None}, base="a", rounds=2, repeats=1,
                    warmup=0)
    assert t.seconds == {"a": [1.0, 10.0], "b": [2.0, 10.0]}
    stat = t.ratio("b")
    assert (stat.lo, stat.hi, stat.rounds) == (1.0, 2.0, 2)
    assert t.speed("b").median == pytest.approx(0.75)
    assert t.ratio("a") == RatioStat(1.0, 1.0, 1.0, 2)


def test_the_flag_says_when_a_spread_straddles_the_goal():
    assert spread_flag(RatioStat(1.01, 0.99, 1.02, 5), 1.03, higher_is_better=False) == "meets"
    assert spread_flag(RatioStat(1.02, 1.00, 1.05, 5), 1.03,
                       higher_is_better=False) == "undecided"
    assert spread_flag(RatioStat(1.10, 1.05, 1.20, 5), 1.03, higher_is_better=False) == "misses"
    assert spread_flag(RatioStat(0.99, 0.98, 1.0, 5), 0.97, higher_is_better=True) == "meets"


def test_wrong_arguments_are_named():
    with pytest.raises(ValueError, match="base='x'"):
        interleaved({"a": lambda: None}, base="x")
    with pytest.raises(ValueError, match="clock='gpu'"):
        interleaved({"a": lambda: None}, base="a", clock="gpu")
    assert isinstance(Timings({"a": [1.0]}, "a", "wall").median_ms("a"), float)
