"""Scenario functions a spawned scenario process can import by name (``bench.runner`` runs
the untimed ones in processes of their own): each records where and when it ran."""
import os
import time
from pathlib import Path

import torch

from bench.runner import ScenarioResult


def _where_and_when(key: str, ctx) -> ScenarioResult:
    start = time.time()
    time.sleep(0.2)
    return ScenarioResult(key, f"{key} title", rows=[{
        "pid": os.getpid(), "threads": torch.get_num_threads(), "progress": ctx.progress,
        "start": start, "end": time.time()}])


def a(ctx) -> ScenarioResult:
    return _where_and_when("a", ctx)


def c(ctx) -> ScenarioResult:
    return _where_and_when("c", ctx)


def timed(ctx) -> ScenarioResult:
    return _where_and_when("timed", ctx)


def fails(ctx) -> ScenarioResult:
    raise RuntimeError("boom")


def waits_for_the_sleeper(ctx) -> ScenarioResult:
    """Returns once ``sleeps`` has started (its pid file exists)."""
    deadline = time.time() + 60
    while not (Path(ctx.out_dir) / "sleeper.pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    return ScenarioResult("first", "first title", rows=[{"pid": os.getpid()}])


def sleeps(ctx) -> ScenarioResult:
    (Path(ctx.out_dir) / "sleeper.pid").write_text(str(os.getpid()))
    time.sleep(120)
    return ScenarioResult("sleeper", "sleeper title")
