"""Timings that a shared 2-core machine cannot fool: interleaved rounds, ratios per round.

Timing one method after another lets the machine's load drift into the comparison (plain
Inductor's training step measured 60.0 ms first and 79.2 ms after four other methods, in one
process). Here every round runs every method once, in an order that rotates from round to
round (A B C, B C A, C A B, …), each after a fresh warm-up call; a method's time in a round is
the median of its repeats, and its **ratio** to the baseline is taken *within the round*, so
a load change between rounds moves both sides. The result per method is the median ratio
over rounds with its spread (min–max); a ratio whose spread crosses its goal is flagged —
that comparison cannot be decided by this run.

The clock is wall time by default. ``clock="cpu"`` reads the process's CPU time
(``time.process_time``: every thread of this process, none of another's), which other
processes' load barely moves; it is the right clock with ``torch.set_num_threads(1)``.

Example::

    from bench.timing import interleaved
    t = interleaved({"plain": f, "geometry": g}, base="plain", rounds=5, repeats=10)
    t.ratio("geometry")           # RatioStat(median=1.02, lo=0.99, hi=1.04, rounds=5)
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["RatioStat", "Timings", "interleaved", "CLOCKS", "spread_flag", "median_seconds"]

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class RatioStat:
    """A method's time over the baseline's, per round: median and range over rounds."""
    median: float
    lo: float
    hi: float
    rounds: int

    def crosses(self, goal: float) -> bool:
        """The spread straddles ``goal``: this run cannot tell whether it is met."""
        return self.lo <= goal <= self.hi and self.lo != self.hi

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


@dataclass(frozen=True)
class Timings:
    """Seconds per call of every method in every round (``seconds[name][round]``)."""
    seconds: dict[str, list[float]]
    base: str
    clock: str

    def median_ms(self, name: str) -> float:
        return 1e3 * statistics.median(self.seconds[name])

    def ratio(self, name: str) -> RatioStat:
        """``time(name) / time(base)`` per round (> 1: slower than the baseline)."""
        per_round = [t / b for t, b in zip(self.seconds[name], self.seconds[self.base])]
        return RatioStat(statistics.median(per_round), min(per_round), max(per_round),
                         len(per_round))

    def speed(self, name: str) -> RatioStat:
        """``time(base) / time(name)`` per round (a throughput ratio: < 1 is slower)."""
        per_round = [b / t for t, b in zip(self.seconds[name], self.seconds[self.base])]
        return RatioStat(statistics.median(per_round), min(per_round), max(per_round),
                         len(per_round))


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` discarded calls."""
    for _ in range(warmup):
        fn()
    return _median_call(fn, repeats, time.perf_counter)


def _median_call(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def interleaved(fns: dict[str, Callable[[], object]], *, base: str, rounds: int = 5,
                repeats: int = 5, warmup: int = 1, clock: str = "wall",
                on_round: Optional[Callable[[int], None]] = None) -> Timings:
    """Time every ``fns[name]()`` in ``rounds`` interleaved rounds (rotating order).

    ``warmup`` untimed calls precede each method's repeats in every round (caches, the
    allocator and the branch predictors see that method again). Compile before calling this:
    the first call of a compiled model is not a timing.
    """
    if base not in fns:
        raise ValueError(f"base={base!r} is not one of the timed methods {sorted(fns)}")
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}; allowed values: {sorted(CLOCKS)}")
    names = list(fns)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            for _ in range(warmup):
                fns[name]()
            seconds[name].append(_median_call(fns[name], repeats, CLOCKS[clock]))
        if on_round is not None:
            on_round(r)
    return Timings(seconds, base, clock)


def spread_flag(stat: RatioStat, goal: float, *, higher_is_better: bool) -> str:
    """``"meets"``, ``"misses"`` or ``"undecided"`` (the spread crosses the goal)."""
    if stat.crosses(goal):
        return "undecided"
    ok = stat.median >= goal if higher_is_better else stat.median <= goal
    return "meets" if ok else "misses"
