"""``python -m bench.generate_compiles``: how many graphs, and how many seconds, ``generate`` compiles.

``memory_rounds``' tiny Llama (2 layers, d = 64, random weights) in one process, per program and compiler:
a first ``generate`` (an 8-token prompt, ``--new`` tokens), then a second with an 11-token
prompt; for each, the graphs Dynamo compiled (its ``unique_graphs`` count: the KV-cache
scales' capture of an FP8 cache counts one) and the call's wall time, nearly all of it
compiling. Programs: ``plain`` (``model.compile(backend=compiler)``, Dynamo as users get it),
``apply_`` and ``apply_ fp8`` (``geoscale_fx.apply_(model, compiler=..., kv_cache="fp8")``).
A warm-up round with another model first takes imports and first-use costs out; Dynamo is
reset between programs. Greedy tokens are checked equal across programs with no FP8 cache.

    python -m bench.generate_compiles                       # eager and aot_eager, ≈ 1 min
    python -m bench.generate_compiles --compilers aot_eager --new 6
"""
from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate
from torch._dynamo.utils import counters

import geoscale_fx
from bench.memory_rounds import tiny_llama

__all__ = ["PROGRAMS", "measure", "main"]

PROGRAMS = ("plain", "apply_", "apply_ fp8")


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    return tiny_llama()


def _convert(model, program: str, compiler: str):
    if program == "plain":
        model.compile(backend=compiler)
    elif program == "apply_":
        geoscale_fx.apply_(model, compiler=compiler)
    else:
        geoscale_fx.apply_(model, compiler=compiler, kv_cache="fp8")
    return model


def _generate(model, length: int, new: int) -> torch.Tensor:
    ids = (torch.arange(length) % 120 + 1).reshape(1, length)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              do_sample=False, pad_token_id=0)


def measure(program: str, compiler: str, new: int) -> tuple[dict, list[torch.Tensor]]:
    """One row: compiles and seconds of a first and a second ``generate``; their tokens."""
    torch._dynamo.reset()
    model = _convert(_llama(), program, compiler)
    row, tokens = {"program": program, "compiler": compiler}, []
    for which, length in (("first", 8), ("second", 11)):
        graphs = counters["stats"]["unique_graphs"]        # Dynamo's count of its graphs
        start = time.perf_counter()
        tokens.append(_generate(model, length, new))
        row[f"{which} s"] = time.perf_counter() - start
        row[f"{which} compiles"] = counters["stats"]["unique_graphs"] - graphs
    return row, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generate_compiles",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compilers", nargs="+", default=["eager", "aot_eager"])
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    parser.add_argument("--new", type=int, default=6, help="tokens each generate adds")
    args = parser.parse_args(argv)
    _generate(_convert(_llama(seed=1), "apply_", args.compilers[0]), 8, 2)    # warm-up
    rows, reference = [], {}
    for compiler in args.compilers:
        for program in args.programs:
            row, tokens = measure(program, compiler, args.new)
            if program != "apply_ fp8":
                expected = reference.setdefault(compiler, tokens)
                row["tokens as plain"] = all(torch.equal(a, b) for a, b in zip(tokens, expected))
            rows.append(row)
            print(tabulate([row], headers="keys", floatfmt=".2f"), flush=True)
    print()
    print(tabulate(rows, headers="keys", floatfmt=".2f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
