"""``python -m bench.sync_cost``: FLOPs of one weight sync's KV-cache scales at 7B shapes.

A recalibrating RL loop (NeMo-RL: p99.9 × 1.05 per step; or a max-abs observer) runs a
forward pass over the trainer's batch to observe the keys and values each layer caches;
geoscale evaluates bounds from the key and value projections' weights alone. Per sync, for a
Llama-style model (``SHAPES``: layers ``n``, width ``d``, ``n_q``/``n_kv``
heads of ``d_h``, SwiGLU width ``m``):

* **calibration forward** over ``B`` sequences of ``L`` tokens (``T = B·L``):
  ``2·N·T + 2·n·B·L²·d``, with ``N = n·(d·(n_q + 2·n_kv)·d_h + n_q·d_h·d + 3·d·m)``
  the blocks' linear weights (two FLOPs per weight and token; the LM head is not needed), and causal
  attention's two products ``QKᵀ`` and ``P·V`` at ``L²·d`` each per layer and sequence.
  The percentile's selection over the ``2·n·T·n_kv·d_h`` cached entries comes on top (a
  sort or a histogram; not counted).
* **geoscale** (``attention_scales``: ``WeightKVScales.layers`` and
  ``geoscale_fx.numerics.amax``), what the implementation computes per layer, for every
  query head (the q scale FA3 engines load) and kv head: the folded weight ``A = diag(g)·W``
  (``d·d_h`` products per head; a LayerNorm's offset adds ``c = Wᵀβ + b``, ``2·d·d_h``),
  every column's squared norm (``2·d·d_h``) and, for queries and keys under RoPE, each
  rotated pair's cross product (``d_h/2`` pairs of ``2·d``: ``d·d_h``); before that, one
  sum over every weight read (the finiteness screen: ``d·(n_q + 2·n_kv)·d_h``). An
  RMSNorm+RoPE model: ``n·d·d_h·(5·n_q + 9·n_kv)``; terms of order ``n_kv·d_h`` left out.

    python -m bench.sync_cost                       # both shapes, the default batch
    python -m bench.sync_cost --sequences 64 --length 4096
"""
from __future__ import annotations

import argparse

from tabulate import tabulate


__all__ = ["RL_BATCH", "calibration_flops", "geoscale_flops", "block_weights", "main"]

#: name -> (layers n, width d, query heads n_q, kv heads n_kv, d_h, FFN width, vocabulary)
SHAPES = {
    "Llama-2-7B": (32, 4096, 32, 32, 128, 11008, 32000),
    "Llama-3-8B": (32, 4096, 32, 8, 128, 14336, 128256),
}

#: the trainer's batch the 7B figures assume: 64 prompts × 8 completions of 1024 tokens
RL_BATCH = (512, 1024)


def block_weights(shape: tuple) -> int:
    """``N``: the linear weights of the transformer blocks (no embeddings, no LM head)."""
    layers, d, n_q, n_kv, d_h, mlp, _ = shape
    return layers * (d * (n_q + 2 * n_kv) * d_h + n_q * d_h * d + 3 * d * mlp)


def calibration_flops(shape: tuple, sequences: int, length: int) -> float:
    """A forward pass over ``sequences × length`` tokens (module docstring)."""
    layers, d = shape[:2]
    tokens = sequences * length
    return 2.0 * block_weights(shape) * tokens + 2.0 * layers * sequences * length ** 2 * d


def geoscale_flops(shape: tuple, rope: bool = True, layer_norm: bool = False) -> float:
    """geoscale's q, k and v bounds of every layer at one sync (module docstring)."""
    layers, d, n_q, n_kv, d_h = shape[:5]
    fold = 3 if layer_norm else 1                 # the gain (and the offset's Wᵀβ)
    rotated = fold + 2 + (1 if rope else 0)       # + squared norms (+ rotated pairs)
    per_head = n_q * rotated + n_kv * rotated + n_kv * (fold + 2)
    screen = n_q + 2 * n_kv                       # one sum over every weight read
    return float(layers * (per_head + screen) * d * d_h)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sync_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=RL_BATCH[0])
    parser.add_argument("--length", type=int, default=RL_BATCH[1])
    args = parser.parse_args(argv)
    rows = []
    for name, shape in SHAPES.items():
        calibration = calibration_flops(shape, args.sequences, args.length)
        ours = geoscale_flops(shape)
        rows.append({"model": name, "calibration forward TFLOP": calibration / 1e12,
                     "geoscale GFLOP": ours / 1e9, "ratio": calibration / ours})
    print(f"one sync, trainer's batch {args.sequences} × {args.length} tokens")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
