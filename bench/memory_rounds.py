"""``python -m bench.memory_rounds``: is a converted model that the user deletes freed?

Per entry point, ``--rounds`` rounds in one process of: build a tiny Llama (2 layers,
d = 64), convert it, call it once (a ``generate`` of 3 tokens with ``kv_cache="fp8"``),
delete it, collect garbage; then the resident memory (``VmRSS``) after each round, and how
many of the rounds' parameters are still alive (weak references). Also ``--rounds``
``apply_``/``restore_`` cycles on one model. Plain ``torch.compile`` (``Module.compile``)
is the reference, with the same compiler (``--compiler``, Inductor by default: what users
run; its caches are warm after the first round). Goal: flat, ≤ 2 MB per round after the
first ``--warmup`` rounds.

    python -m bench.memory_rounds                   # 20 rounds each, ≈ 8 min on 2 cores
    python -m bench.memory_rounds --rounds 10 --programs apply_ plain
"""
from __future__ import annotations

import argparse
import gc
import os
import weakref

import torch
from tabulate import tabulate

from bench.memory import _configure, _status

__all__ = ["PROGRAMS", "rounds", "main", "tiny_llama"]

GOAL_MB_PER_ROUND = 2.0


def tiny_llama():
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=128, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


IDS = torch.arange(1, 9).reshape(1, 8)


def _call(model) -> None:
    with torch.no_grad():
        model(IDS)


def _generate(model) -> None:
    with torch.no_grad():
        model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3,
                       do_sample=False, pad_token_id=0)


def _converters(compiler: str):
    import geoscale_fx

    def plain(m):
        m.compile(backend=compiler)
        return m

    return {
        "plain torch.compile": (plain, _call),
        "apply_": (lambda m: geoscale_fx.apply_(m, compiler=compiler), _call),
        "wrap": (lambda m: geoscale_fx.wrap(m, compiler=compiler), _call),
        "torch.compile, geoscale backend": (
            lambda m: torch.compile(m, backend=geoscale_fx.backend(compiler=compiler)), _call),
        "compile_blocks": (lambda m: (geoscale_fx.compile_blocks(m, m.model.layers,
                                                                 compiler=compiler), m)[1],
                           _call),
        "plain torch.compile, generate": (plain, _generate),
        "apply_, kv_cache=fp8, generate": (
            lambda m: geoscale_fx.apply_(m, kv_cache="fp8", compiler=compiler), _generate),
    }


PROGRAMS = ("plain torch.compile", "apply_", "wrap", "torch.compile, geoscale backend",
            "compile_blocks", "plain torch.compile, generate",
            "apply_, kv_cache=fp8, generate", "apply_/restore_ cycles")


def _rss_mb() -> float:
    gc.collect()
    return _status("VmRSS") / 2 ** 20


def rounds(program: str, count: int, compiler: str = "inductor") -> tuple[list[float], int]:
    """Resident MB after each round, and how many rounds' parameters are alive at the end."""
    import geoscale_fx

    torch._dynamo.reset()
    alive, rss = [], []
    if program == "apply_/restore_ cycles":
        model = tiny_llama()
        for _ in range(count):
            geoscale_fx.apply_(model, compiler=compiler)
            _call(model)
            geoscale_fx.restore_(model)
            rss.append(_rss_mb())
        return rss, 0
    convert, run = _converters(compiler)[program]
    for _ in range(count):
        model = tiny_llama()
        alive.append(weakref.ref(model.model.layers[0].self_attn.q_proj.weight))
        converted = convert(model)
        run(converted)
        del model, converted
        rss.append(_rss_mb())
    return rss, sum(r() is not None for r in alive)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory_rounds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compiler", choices=["inductor", "aot_eager"], default="inductor",
                        help="aot_eager runs flex_attention eagerly, and torch's eager "
                        "flex_attention compiles itself with a new backend per call, each kept "
                        "by Dynamo: a growth of torch's own (plain compile avoids flex)")
    parser.add_argument("--programs", nargs="+", choices=PROGRAMS, default=list(PROGRAMS),
                        metavar="PROGRAM")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _configure()           # freed tensors leave the resident set at once (bench.memory)
    rows = []
    for program in args.programs:
        rss, alive = rounds(program, args.rounds, args.compiler)
        after = rss[args.warmup - 1:]
        growth = (after[-1] - after[0]) / max(len(after) - 1, 1)
        rows.append({"program": program, "rounds": args.rounds,
                     "parameters alive": alive,
                     f"RSS after round {args.warmup} MB": after[0],
                     "RSS at the end MB": rss[-1],
                     "MB per round after warm-up": growth,
                     "flat": growth <= GOAL_MB_PER_ROUND})
        print(tabulate([rows[-1]], headers="keys", floatfmt=".2f"), flush=True)
    print(f"\n{args.rounds} rounds per program, compiler {args.compiler} (goal ≤ "
          f"{GOAL_MB_PER_ROUND} MB per round after {args.warmup})")
    print(tabulate(rows, headers="keys", floatfmt=".2f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
