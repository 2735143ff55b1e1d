"""Dynamo's per-compile work that only feeds its own logs and metrics, left out in test
processes (the pytest workers, ``tests/conftest.py``, and the processes
``tests/test_distributed.py`` spawns).

The suite makes thousands of Dynamo compiles (a py-spy profile of the whole suite, torch
2.13, 2 workers: ~1250 s of CPU, 70% of it inside Dynamo's ``_compile``). Three pieces of
each compile do nothing a test can observe:

- ``profile_guard_manager``: after building a frame's guards, Dynamo times one evaluation of
  them for its compile metrics (``guard_latency_us``), after flushing the CPU's caches:
  ~16 ms a compile on this machine, ~4% of the suite's CPU.
- ``side_effect_replay_policy="info"`` (the default): the user stack of every mutation of a
  Python object (an HF cache's lists, geoscale's host counters) is recorded while tracing and
  formatted into a message when the graph is generated, whether or not
  ``TORCH_LOGS=side_effects`` is on: ~2% of the suite's CPU. ``"silent"`` allows the same
  side effects and replays them the same way; only the log message is not made.
- torch's structured trace (``torch._logging.trace_structured``, what ``TORCH_TRACE`` writes
  for tlparse) makes its payloads — each graph printed, each guard tree as text — whenever its
  logger ``torch.__trace`` has a handler. It has none outside a ``TORCH_TRACE`` run, but
  pytest (9) attaches its capture handlers to every logger that does not propagate, which
  this one does not: in the suite every compile printed its graphs into the tests' captured
  logs (~2.5% of the suite's CPU). Letting it propagate, with no handler of its own, keeps
  pytest's handlers off it, so the trace is off as it is outside pytest (a ``TORCH_TRACE``
  run keeps it as torch sets it up).

None changes a graph, a guard or a result: the guards are still built and checked once
against the frame (Dynamo's own sanity check is kept), and side effects are still replayed.
Every torch the package admits (2.11 to 2.15) has all three.
"""
from __future__ import annotations

import os

import torch
import torch._dynamo.guards
import torch._logging._internal

__all__ = ["skip_log_only_bookkeeping"]


def _no_latency_profile(*args, **kwargs) -> float:
    return 0.0


def skip_log_only_bookkeeping() -> None:
    """Leave out the guard-latency profile, the side-effect log messages and the structured
    trace's payloads (module doc)."""
    torch._dynamo.config.side_effect_replay_policy = "silent"
    torch._dynamo.guards.profile_guard_manager = _no_latency_profile
    if not os.environ.get("TORCH_TRACE"):      # a trace asked for is written as usual
        trace_log = torch._logging._internal.trace_log
        for handler in list(trace_log.handlers):  # torch's lazy one, which drops itself at
            trace_log.removeHandler(handler)      # the first record (nowhere to write it)
        trace_log.propagate = True
