"""Host µs of ``GraphRuntime.__call__`` per decode step: ``python -m bench.host_overhead``.

The decode step of ``bench.profile_step`` (a StaticCache, one new token, the zoo's GPT-2 shape)
for ``scaling="none"`` and ``"geometry"``, timed two ways:

* **replay** — the decode graph's runtime called directly with the arguments of a real call,
  its compiled variant replaced by a stub that returns that call's output: the host part
  alone (µs per call = loop time / calls − the stub's), ``--calls`` calls per round;
* **steps** — real decode steps; per call, the time inside ``GraphRuntime.__call__`` minus
  the time inside the compiled graph (the median per round).

Both report the median over ``--rounds`` rounds and the minimum, and how many calls missed
the runtime's fast path (0 for ``geometry``; ``none`` has no inference variant to reuse: its
calls all take the full path, which has nothing to refresh or re-measure).
``--profile`` prints the replay loop's cProfile (tottime). On a shared machine take medians
of several rounds; ``--threads 1`` keeps the graph on one core; ``--compiler eager`` only
for a quick check of the bench itself.

    python -m bench.host_overhead --context 256 --calls 2000 --rounds 5 --threads 1
    python -m bench.host_overhead --programs geometry --profile
"""
from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import time
from typing import Callable

import torch
from tabulate import tabulate

import geoscale_fx
from bench.profile_step import _config
from geoscale_fx.compile.backend_registry import BACKENDS
from geoscale_fx.runtime.graph_runtime import GraphRuntime

__all__ = ["main", "run", "decode_runtime", "replay_us", "steps_us"]


def decode_runtime(config, program: str, context: int, compiler: str = "inductor"):
    """``(step, runtime)``: one greedy decode step at position ``context // 2`` of a
    StaticCache, and the ``GraphRuntime`` of its decode graph."""
    import transformers

    before = {id(r) for b in BACKENDS.live() for r in b.runtimes}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa").eval()
    geoscale_fx.apply_(model, scaling=program, compiler=compiler)
    cache = transformers.StaticCache(config=config, max_cache_len=context)
    prompt = context // 2
    ids = torch.randint(0, config.vocab_size, (1, prompt))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(prompt))
    token, position = ids[:, -1:], torch.tensor([prompt])

    def step():
        for layer in cache.layers:   # rewrite slot ``prompt`` every call (profile_step)
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.fill_(prompt)
        with torch.no_grad():
            return model(input_ids=token, past_key_values=cache, use_cache=True,
                         cache_position=position).logits

    step()
    new = [r for b in BACKENDS.live() for r in b.runtimes if id(r) not in before]
    calls = [r.full_steps + r.reused_steps for r in new]
    step()
    runtime, = [r for r, n in zip(new, calls) if r.full_steps + r.reused_steps > n]  # decode
    return step, runtime


def _captured_call(step: Callable, runtime: GraphRuntime) -> tuple[tuple, object]:
    """The arguments and output of the runtime's call in one decode step."""
    seen = []
    original = GraphRuntime.__call__

    def spy(self, *args):
        out = original(self, *args)
        if self is runtime:
            seen.append((args, out))
        return out

    GraphRuntime.__call__ = spy
    try:
        step()
    finally:
        GraphRuntime.__call__ = original
    return seen[-1]


def replay_us(step: Callable, runtime: GraphRuntime, calls: int, rounds: int,
              profile: bool = False) -> tuple[list[float], int]:
    """Host µs per call of ``runtime`` with a stub graph, one value per round; and how many
    of the timed calls did not take the fast path."""
    args, out = _captured_call(step, runtime)
    stub = lambda *a: out  # noqa: E731
    saved = {name: v._value for name, v in runtime.variants.items()}
    for variant in runtime.variants.values():
        variant._value = stub
    try:
        runtime(*args)
        fast = runtime.fast_steps
        per_round = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                runtime(*args)
            t1 = time.perf_counter_ns()
            for _ in range(calls):
                stub(*args)
            t2 = time.perf_counter_ns()
            per_round.append(((t1 - t0) - (t2 - t1)) / calls / 1e3)
        slow = rounds * calls - (runtime.fast_steps - fast)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                runtime(*args)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    finally:
        for name, value in saved.items():
            runtime.variants[name]._value = value
    return per_round, slow


def steps_us(step: Callable, runtime: GraphRuntime, calls: int, rounds: int) -> list[float]:
    """Per round, the median over real decode steps of µs in ``__call__`` minus the graph."""
    inside = [0]
    original = GraphRuntime.__call__
    saved = {name: v._value for name, v in runtime.variants.items()}

    def timed(compiled):
        def run(*a):
            t0 = time.perf_counter_ns()
            try:
                return compiled(*a)
            finally:
                inside[0] += time.perf_counter_ns() - t0
        return run

    host: list[int] = []

    def spy(self, *args):
        inside[0] = 0
        t0 = time.perf_counter_ns()
        out = original(self, *args)
        if self is runtime:
            host.append(time.perf_counter_ns() - t0 - inside[0])
        return out

    for name, value in saved.items():
        if value is not None:
            runtime.variants[name]._value = timed(value)
    GraphRuntime.__call__ = spy
    try:
        per_round = []
        for _ in range(rounds):
            host.clear()
            for _ in range(calls):
                step()
            per_round.append(statistics.median(host) / 1e3)
    finally:
        GraphRuntime.__call__ = original
        for name, value in saved.items():
            runtime.variants[name]._value = value
    return per_round


def run(argv: list[str] | None = None) -> list[dict]:
    """The table's rows, one per program (``main`` prints them)."""
    parser = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", nargs="+", choices=["none", "geometry"],
                        default=["none", "geometry"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000, help="replay calls per round")
    parser.add_argument("--steps", type=int, default=300, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--profile", action="store_true", help="cProfile the replay loop")
    parser.add_argument("--compiler", default="inductor", help="geoscale's compiler")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for program in args.programs:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            step, runtime = decode_runtime(_config("gpt2", args.context), program,
                                           args.context, args.compiler)
            replay, slow = replay_us(step, runtime, args.calls, args.rounds, args.profile)
            fast = runtime.fast_steps
            real = steps_us(step, runtime, args.steps, args.rounds) if args.steps else [0.0]
        rows.append({"program": program, "cache": args.context,
                     "replay µs/call (median)": statistics.median(replay),
                     "replay min": min(replay),
                     "steps host µs (median)": statistics.median(real),
                     "steps min": min(real),
                     "slow calls in replay": slow,
                     "slow calls in steps": args.rounds * args.steps - (runtime.fast_steps - fast)})
    print(f"\ngpt2 decode ({args.compiler}), {args.rounds} rounds of {args.calls} replay "
          f"calls and {args.steps} steps, {torch.get_num_threads()} thread(s)\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    print(tabulate(run(argv), headers="keys", floatfmt=".2f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
