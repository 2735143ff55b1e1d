"""Where a step's time goes: ``python -m bench.profile_step`` (issue 19, "know where the time goes").

One decode step (a StaticCache, one new token), one forward and one training step of a
Hugging Face causal LM (random weights, the zoo's small GPT-2/Llama shapes, or ``--context``
for a longer one) under Inductor, for five programs that differ by one thing each:

* ``plain``      — ``torch.compile`` (SDPA's kernel);
* ``none``       — geoscale with ``scaling="none"``, planned as geometry is (the same
  lowering): the attention kernel geoscale runs and its host runtime, no bound, no FP8;
* ``no-fp8``     — geometry with the FP8 round trip replaced by the identity at compile time
  (``compiling``): the bound's nodes, the scaling state and its host checks, the divide and
  multiply by the scale — everything but the saturating cast to FP8 and back;
* ``geometry``   — the default: + the FP8 round trip;
* ``current``    — current scaling (S materialized, the observed max), for reference.

So ``none − plain`` is the kernel's share (flex_attention's CPU template or a materialized
attention against SDPA's kernel) plus the runtime's host work, ``no-fp8 − none`` what the
bound costs — geoscale's own work — and ``geometry − no-fp8`` the FP8 round trip, which any
FP8 scaling pays (emulated in software on CPU, a native cast on FP8 GPUs). A torch.profiler pass over
the geometry decode step splits host from compiled time ("Torch-Compiled Region" minus
"CompiledFxGraph": guards, the runtime's variant choice, argument plumbing).

Times are interleaved rounds (``bench.timing``); ``--clock cpu --threads 1`` measures this
process's CPU time, which other processes' load on a shared machine barely moves.

    python -m bench.profile_step                       # gpt2 shape, batch 1 and 8
    python -m bench.profile_step --family llama --context 2048 --batch 1
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
from typing import Callable
from unittest import mock

import torch
from tabulate import tabulate
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.core import compat
from bench.lms import with_named_loss
from bench.timing import interleaved
from geoscale_fx.core import fp8

__all__ = ["main", "decode_programs"]

log = logging.getLogger("bench")

PROGRAMS = ("plain", "none", "no-fp8", "geometry", "current")
SHAPES = {  # the zoo's small pretrained shapes (models_zoo.configs.HF_SMALL)
    "gpt2": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=256,
                 activation_function="gelu_new"),
    "llama": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=16, intermediate_size=448, vocab_size=256),
}


def _config(family: str, context: int, width: int | None = None):
    """The family's zoo shape; ``width``: its hidden size instead, the head size kept (heads,
    and the MLP and key/value heads in proportion)."""
    import transformers

    size = ({"n_positions": context} if family == "gpt2" else
            {"max_position_embeddings": context})
    shape = dict(SHAPES[family])
    if width is not None:
        if family == "gpt2":
            head = shape["n_embd"] // shape["n_head"]
            shape.update(n_embd=width, n_head=max(1, width // head))
        else:
            heads = max(1, width // shape["head_dim"])
            group = shape["num_attention_heads"] // shape["num_key_value_heads"]
            shape.update(hidden_size=width, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // group),
                         intermediate_size=shape["intermediate_size"] * width
                         // shape["hidden_size"])
    return transformers.AutoConfig.for_model(family, **shape, **size)


def _model(config, program: str, training: bool):
    import transformers

    torch.manual_seed(0)
    model = with_named_loss(
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    model.train(training)
    if program == "plain":
        model.generation_config.disable_compile = True
        # what model.compile installs, in a cache region of its own
        model._compiled_call_impl = compat.compile_isolated(model._call_impl,
                                                            backend="inductor")
        return model
    scaling = {"none": "none", "no-fp8": "geometry", "geometry": "geometry",
               "current": "current"}[program]
    return geoscale_fx.apply_(model, scaling=scaling, compiler="inductor")


def _identity_round_trip(scaled, fmt="e4m3"):
    return scaled


@contextlib.contextmanager
def compiling(program: str):
    """Around a program's first calls (its compiles): for ``no-fp8``, geometry's graphs with
    the FP8 round trip (``fp8.quantize_dequantize``: saturate, cast, cast back) replaced by
    the identity — the bound, the state and the divide/multiply by the scale kept — compiled
    without geoscale's graph cache (whose key is geoscale's source, not this patch)."""
    if program != "no-fp8":
        yield
        return
    from torch._inductor import config

    # both lowerings round through fp8.quantize_dequantize (fp8.fake_quantize_logits)
    with mock.patch.object(fp8, "quantize_dequantize", _identity_round_trip), \
            config.patch(fx_graph_cache=False):
        yield


def decode_programs(config, batch: int, context: int) -> dict[str, Callable[[], object]]:
    """One greedy decode step per call, at position ``context // 2`` of a StaticCache."""
    from transformers import StaticCache

    out = {}
    prompt = context // 2
    ids = torch.randint(0, config.vocab_size, (batch, prompt))
    for program in PROGRAMS:
        model = _model(config, program, training=False)
        cache = StaticCache(config=config, max_cache_len=context)
        with torch.no_grad(), compiling(program):
            model(input_ids=ids, past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(prompt))
        token = ids[:, -1:]
        position = torch.tensor([prompt])
        calls = [0]

        def step(model=model, cache=cache, token=token, position=position, calls=calls):
            # every call rewrites slot ``prompt``, but a StaticCache layer also counts the
            # tokens it was given (``cumulative_length``, which positions derive from): wind
            # it back before it passes the cache's end (amortized: once per prompt calls)
            calls[0] += 1
            if calls[0] % prompt == 0:
                for layer in cache.layers:
                    if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                        layer.cumulative_length.fill_(prompt)
            with torch.no_grad():
                return model(input_ids=token, past_key_values=cache, use_cache=True,
                             cache_position=position).logits
        with compiling(program):
            step()   # compiles the decode graph
        out[program] = step
    return out


def forward_programs(config, batch: int, length: int) -> dict[str, Callable[[], object]]:
    out = {}
    ids = torch.randint(0, config.vocab_size, (batch, length))
    for program in PROGRAMS:
        model = _model(config, program, training=False)

        def forward(model=model):
            with torch.no_grad():
                return model(input_ids=ids, use_cache=False).logits
        with compiling(program):
            forward()
        out[program] = forward
    return out


def train_programs(config, batch: int, length: int) -> dict[str, Callable[[], object]]:
    out = {}
    ids = torch.randint(0, config.vocab_size, (batch, length))
    for program in PROGRAMS:
        model = _model(config, program, training=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
        with compiling(program):
            step()
        out[program] = step
    return out


def host_split(step: Callable[[], object], calls: int = 20) -> dict[str, float]:
    """µs per call inside the compiled region, in the compiled graph, and host around it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
    region = graph = 0.0
    for event in prof.key_averages():
        if event.key.startswith("Torch-Compiled Region"):
            region += event.cpu_time_total
        elif event.key.startswith("## Call CompiledFxGraph"):
            graph += event.cpu_time_total
    return {"compiled region µs": region / calls, "compiled graph µs": graph / calls,
            "host µs": (region - graph) / calls}


#: the differences a step's table shows: (label, minuend, subtrahend)
DIFFERENCES = (("kernel + runtime (none - plain)", "none", "plain"),
               ("bound + FP8 (geometry - none)", "geometry", "none"),
               ("bound (no-fp8 - none)", "no-fp8", "none"),
               ("FP8 round trip (geometry - no-fp8)", "geometry", "no-fp8"))


def breakdown_rows(what: str, timings, shape: str) -> list[dict]:
    """The table rows of one measured step: each program, and the differences."""
    ms = {p: timings.median_ms(p) for p in PROGRAMS}
    rows = [{"step": what, "shape": shape, "program": p, "ms": ms[p],
             "ratio to plain": timings.ratio(p).median,
             "spread": f"{timings.ratio(p).lo:.3f}-{timings.ratio(p).hi:.3f}"}
            for p in PROGRAMS]
    rows += [{"step": what, "shape": shape, "program": label, "ms": ms[a] - ms[b],
              "ratio to plain": (ms[a] - ms[b]) / ms["plain"]} for label, a, b in DIFFERENCES]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument("--context", type=int, nargs="+", default=[256],
                        help="cache lengths of decode (a curve over several)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", nargs="+", choices=["decode", "forward", "train"],
                        default=["decode", "forward", "train"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--width", type=int, default=None,
                        help="hidden size instead of the zoo shape's (head size kept): "
                             "how the per-step costs scale with the model")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = _config(args.family, max(max(args.context), 128), args.width)
    rows, host = [], []
    jobs = [(what, batch, context) for batch in args.batch for what in args.steps
            for context in (args.context if what == "decode" else [128])]
    torch._dynamo.config.automatic_dynamic_shapes = False   # each shape its static graph
    for what, batch, context in jobs:
        torch._dynamo.reset()
        if what == "decode":
            programs = decode_programs(_config(args.family, context, args.width), batch,
                                       context)
        else:
            programs = (forward_programs if what == "forward" else train_programs)(
                config, batch, 128)
        graphs = counters["stats"]["unique_graphs"]
        timings = interleaved(programs, base="plain", rounds=args.rounds,
                              repeats=args.repeats if what != "train" else
                              max(2, args.repeats // 3), clock=args.clock)
        if counters["stats"]["unique_graphs"] != graphs:   # outside ``compiling``
            log.warning("a program compiled again while timed: its no-fp8 graph may be "
                        "geometry's (%s)", what)
        shape = f"b{batch} cache {context}" if what == "decode" else f"b{batch}x128"
        rows += breakdown_rows(what, timings, shape)
        if what == "decode":
            host += [{"program": p, "shape": shape, **host_split(programs[p])}
                     for p in PROGRAMS]
        print(tabulate(rows[-len(PROGRAMS) - len(DIFFERENCES):], headers="keys",
                       floatfmt=".4g"),
              flush=True)
    print(f"\n{args.family} (hidden size {config.hidden_size}), {torch.get_num_threads()} "
          f"threads, clock={args.clock}, "
          f"{args.rounds} interleaved rounds\n")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    if host:
        print("\nHost vs compiled time per decode call (torch.profiler):")
        print(tabulate(host, headers="keys", floatfmt=".1f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
