"""``python -m models_zoo.inspection NAME``: ``geoscale inspect`` for a zoo model (from a checkout).

    python -m models_zoo.inspection hf-llama
    python -m models_zoo.inspection llama-2-70b --size full     # the meta device: no bounds
    geoscale inspect models_zoo.inspection:hf-llama             # the same, as a spec

As a spec, ``models_zoo.inspection:NAME`` is a callable returning ``(model, inputs)`` of zoo
model NAME, small size, SDPA (``geoscale export-kv-scales`` takes it too).
"""
from __future__ import annotations

import argparse
import sys
from functools import partial

from geoscale_fx.api.inspection import sites_report
from geoscale_fx.sites.model import ROPE_BOUNDS

from models_zoo.registry import get, names, sizes

__all__ = ["model_and_inputs", "main"]


def model_and_inputs(name: str, size: str = "small", attn_implementation: str = "sdpa",
                     batch: int = 1, seq_len: int = 32) -> tuple:
    """Zoo model ``name`` and the keyword arguments of one call (no KV cache)."""
    zoo = get(name, size, attn_implementation=attn_implementation)
    inputs = zoo.example_inputs(batch=batch, seq_len=seq_len)
    if zoo.family in ("gpt2", "llama", "mistral"):
        inputs["use_cache"] = False
    return zoo.model, inputs


def __getattr__(name: str):
    """``models_zoo.inspection:NAME`` (a ``geoscale inspect`` spec): a builder of NAME."""
    if name in names():
        return partial(model_and_inputs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; zoo names: {names()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models_zoo.inspection",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=names())
    parser.add_argument("--size", choices=("small", "full"), default="small",
                        help="paper architectures: scaled-down (default) or full size (meta)")
    parser.add_argument("--attn-impl", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--rope-bound", choices=ROPE_BOUNDS, default="norm_product")
    args = parser.parse_args(argv)
    if args.size not in sizes(args.name):
        parser.error(f"--size {args.size}: {args.name} comes in {sizes(args.name)}")
    model, inputs = model_and_inputs(args.name, args.size, args.attn_impl, args.batch,
                                     args.seq_len)
    print(f"{args.name} ({args.size})")
    print(sites_report(model, inputs, args.rope_bound))
    return 0


if __name__ == "__main__":
    sys.exit(main())
