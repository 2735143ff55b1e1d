"""``python -m bench.certified_cost``: what certified bounds cost per training step at 7B shapes.

geoscale's default estimator is the exact route (certified at every step): per head the Gram
matrices ``G = Aᵀ A`` (``d_h × d_h``) of the folded query and key weights, then
``σ_h = √λ_max(G_Q G_K)`` (no RoPE) or ``‖A_q,h‖·‖A_k,g‖ = √λ_max(G_Q)·√λ_max(G_K)`` (RoPE,
the norm product), in float64. The paper's warm power iteration (``estimator="power"``, one
step per call) is cheaper and a lower bound of σ: not certified once the weights move.

For real shapes — Llama-2-7B (32 layers, d = 4096, 32 heads, d_h = 128, MHA) and
Llama-3-8B (GQA 32:8) — this times one layer's bound on this machine's CPU (median of
``--repeats``), counts the floating-point operations of the whole model's bounds per step,
and divides by those of one training step on ``--tokens`` tokens (forward and backward:
``6·N·T`` for the N weights of the linear layers, plus ``6·n_layers·T²·d`` for causal
attention's two products). FLOPs of the bound: the Gram matrices ``2·d·d_h²`` per head and
side; per head ``≈ 4/3·d_h³`` for an eigenvalue-only symmetric solve (the norm product
needs one per side), ``≈ 9·d_h³`` for the eigendecomposition the σ route takes of ``G_K`` (a
square root), two ``d_h³`` products and one eigenvalue solve.

    python -m bench.certified_cost                     # both models, ≈ 1 min on 2 cores
    python -m bench.certified_cost --threads 1 --repeats 5
"""
from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

from geoscale_fx.core import spectral

__all__ = ["SHAPES", "bound_flops", "step_flops", "main"]

GOAL = 0.01
#: name -> (layers, d, query heads, kv heads, d_h, MLP width, vocabulary)
SHAPES = {
    "Llama-2-7B": (32, 4096, 32, 32, 128, 11008, 32000),
    "Llama-3-8B": (32, 4096, 32, 8, 128, 14336, 128256),
}


def bound_flops(route: str, d: int, n_q: int, n_kv: int, d_h: int) -> float:
    """Floating-point operations of one layer's bound (module docstring)."""
    grams = 2.0 * d * d_h ** 2 * (n_q + n_kv)
    if route == "norm product (RoPE)":
        return grams + 4 / 3 * d_h ** 3 * (n_q + n_kv)
    if route == "sigma":
        return grams + 9.0 * d_h ** 3 * n_kv + (2 * 2.0 + 4 / 3) * d_h ** 3 * n_q
    if route == "power step":          # one warm step: (A_k v), (A_q u) and back, per head
        return 4 * 2.0 * d * d_h * n_q
    raise ValueError(route)


def step_flops(shape: tuple, tokens: int) -> float:
    """One training step on ``tokens`` tokens: ``6·N·T + 6·n_layers·T²·d`` (causal)."""
    layers, d, n_q, n_kv, d_h, mlp, vocab = shape
    per_layer = d * (n_q + 2 * n_kv) * d_h + n_q * d_h * d + 3 * d * mlp
    n = layers * per_layer + vocab * d          # the LM head (embeddings are gathers)
    return 6.0 * n * tokens + 6.0 * layers * tokens ** 2 * d


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _routes(a_q: torch.Tensor, a_k: torch.Tensor) -> dict:
    u = torch.randn(a_q.shape[0], a_q.shape[1])
    v = torch.randn(a_q.shape[0], a_k.shape[1])           # per query head
    return {
        "norm product (RoPE)": lambda: (spectral.head_spectral_norms(a_q),
                                        spectral.head_spectral_norms(a_k)),
        "sigma": lambda: spectral.per_head_sigma_exact(a_q, a_k),
        "power step": lambda: spectral.per_head_power_step(a_q, a_k, u.clone(), v.clone(), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.certified_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        shape = SHAPES[name]
        layers, d, n_q, n_kv, d_h = shape[:5]
        gen = torch.Generator().manual_seed(0)
        a_q = torch.randn(n_q, d, d_h, generator=gen) / d ** 0.5
        a_k = torch.randn(n_kv, d, d_h, generator=gen) / d ** 0.5
        step = step_flops(shape, args.tokens)
        for route, fn in _routes(a_q, a_k).items():
            flops = bound_flops(route, d, n_q, n_kv, d_h)
            seconds = _time(fn, args.repeats)
            rows.append({"model": name, "route": route,
                         "certified": route != "power step",
                         "one layer, CPU s": seconds,
                         "GFLOP/s measured": flops / seconds / 1e9,
                         "model TFLOP / step": layers * flops / 1e12,
                         f"share of a {args.tokens}-token step": layers * flops / step})
    print(f"torch {torch.__version__}, {args.threads} thread(s); a training step on "
          f"{args.tokens} tokens: " + ", ".join(f"{m} {step_flops(SHAPES[m], args.tokens) / 1e12:.0f} "
                                               "TFLOP" for m in args.models))
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    worst = max(r[f"share of a {args.tokens}-token step"] for r in rows if r["certified"])
    print(f"\ncertified routes: at most {worst:.3%} of a step (goal ≤ {GOAL:.0%}): "
          f"{'meets' if worst <= GOAL else 'misses'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
