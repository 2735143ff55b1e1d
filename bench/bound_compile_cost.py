"""What geoscale's in-graph bound costs a training compile, and what it would cost alone.

A geometry site computes its scale in the graph from the weights (``GeometryScaling.predict``:
the Grams, the Schatten iteration, the offset terms; ~275 ATen nodes a site). In a training
graph AOTAutograd traces it into the joint graph, and its min-cut partitioner cuts it with the
rest. This times the first call of a training step (forward, loss, backward) from a fresh
Dynamo for the zoo's GPT-2 and Llama shapes (``bench.profile_step.SHAPES``), under
``compiler="aot_eager"`` (AOTAutograd without Inductor: the compile the suite makes), one
thread, the programs interleaved in each round, medians over rounds:

* ``none``, ``delayed``, ``geometry``: the whole step's compile (``scaling=...``);
* ``bound alone``: the geometry sites' scale programs, captured from an eager step, traced
  forward-only by AOTAutograd (``aot_function`` under ``no_grad``): what the bound would cost
  as a graph of its own, outside the joint graph, with its node count.

    python -m bench.bound_compile_cost [--families gpt2 llama] [--layers 4] [--rounds 3]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from functorch.compile import aot_function, make_boxed_func
from tabulate import tabulate

import geoscale_fx
from bench.lms import with_named_loss
from bench.profile_step import _config
from geoscale_fx.compile import rewrite

__all__ = ["training_compile_seconds", "captured_scale_programs", "bound_alone", "run"]

LENGTH = 64
PROGRAMS = ("none", "delayed", "geometry")


def _model(family: str, layers: int, scaling: str, compiler: str):
    import transformers

    config = _config(family, LENGTH)
    config.update({"n_layer" if family == "gpt2" else "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return geoscale_fx.apply_(with_named_loss(model).train(), scaling=scaling, compiler=compiler)


def _step(model) -> None:
    ids = torch.randint(0, 256, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def training_compile_seconds(family: str, layers: int, scaling: str) -> float:
    """Seconds of the first training step under ``aot_eager``, from a fresh Dynamo."""
    torch._dynamo.reset()
    model = _model(family, layers, scaling, "aot_eager")
    gc.collect()
    start = time.perf_counter()
    _step(model)
    return time.perf_counter() - start


def captured_scale_programs(family: str, layers: int) -> list[tuple]:
    """``(plan, weights, state, seq_len)`` of each geometry site's scale program, as an eager
    training step calls it (``compile.rewrite._predict``), one per site."""
    captured, original = {}, rewrite._predict

    def capture(plan, weights, state, seq_len):
        captured.setdefault(plan.site.name, (
            plan, {k: v.detach().clone() for k, v in weights.items()},
            {k: v.clone() for k, v in state.items()}, seq_len))
        return original(plan, weights, state, seq_len)

    rewrite._predict = capture
    try:
        torch._dynamo.reset()
        _step(_model(family, layers, "geometry", "eager"))
    finally:
        rewrite._predict = original
    return list(captured.values())


def bound_alone(programs: list[tuple]) -> tuple[float, int]:
    """Seconds and forward-graph nodes of AOTAutograd tracing ``programs`` forward-only."""
    layout, tensors = [], []
    for plan, weights, state, seq_len in programs:
        layout.append((plan, list(weights), list(state), seq_len))
        tensors += [*weights.values(), *state.values()]

    def scales(*args):
        out, i = [], 0
        for plan, weight_names, state_names, seq_len in layout:
            weights = dict(zip(weight_names, args[i:i + len(weight_names)]))
            i += len(weight_names)
            state = dict(zip(state_names, args[i:i + len(state_names)]))
            i += len(state_names)
            out.append(rewrite._predict(plan, weights, state, seq_len))
        return out

    nodes = []

    def count(gm, _inputs):
        nodes.append(len(gm.graph.nodes))
        return make_boxed_func(gm.forward)

    traced = aot_function(scales, fw_compiler=count)
    inputs = [t.clone() for t in tensors]
    gc.collect()
    start = time.perf_counter()
    with torch.no_grad():
        traced(*inputs)
    return time.perf_counter() - start, nodes[0]


def run(families=("gpt2", "llama"), layers: int = 4, rounds: int = 3) -> list[dict]:
    rows = []
    for family in families:
        programs = captured_scale_programs(family, layers)
        training_compile_seconds(family, layers, "none")    # imports and first-use set-up
        seconds = {p: [] for p in (*PROGRAMS, "bound alone")}
        nodes = 0
        for r in range(rounds):
            order = PROGRAMS[r % len(PROGRAMS):] + PROGRAMS[:r % len(PROGRAMS)]
            for program in order:
                seconds[program].append(training_compile_seconds(family, layers, program))
            s, nodes = bound_alone(programs)
            seconds["bound alone"].append(s)
        none = statistics.median(seconds["none"])
        for program, values in seconds.items():
            median = statistics.median(values)
            rows.append({"family": family, "program": program, "sites": len(programs),
                         "compile s": median, "ratio to none": median / none,
                         "bound nodes": nodes if program == "bound alone" else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bound_compile_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama"],
                        choices=["gpt2", "llama"])
    parser.add_argument("--layers", type=int, default=4, help="blocks (the zoo's: 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(tuple(args.families), args.layers, args.rounds)
    print(f"first training step under aot_eager, batch 1 x {LENGTH}, {args.layers} blocks, "
          f"{args.threads} thread(s), median of {args.rounds} interleaved rounds; 'bound alone': "
          "the geometry sites' scale programs traced forward-only")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
