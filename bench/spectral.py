"""Cost of the spectral estimators on full-size layer shapes (random weights).

For Mistral-7B and Llama-2-13B attention layers this times, in one process:

* one warm per-head power iteration (the per-step cost of ``estimator="power"``),
* the exact per-head computation (``estimator="exact"`` and every cold start),
* the naive route: forming the paper's d×d ``M = W^Q W^Kᵀ`` and ``torch.linalg.matrix_norm``,

and prints each as a ratio to the power iteration. Run ``python -m bench.spectral``.
"""
from __future__ import annotations

import argparse
import json
import logging
import math

import torch
from tabulate import tabulate

from bench.timing import median_seconds
from geoscale_fx.core import spectral
from geoscale_fx.testing.paper_models import PAPER_MODELS

log = logging.getLogger("bench.spectral")

MODELS = ("Mistral-7B", "Llama-2-13B")


def _layer(model, generator):
    d, dh = model.model_dim, model.head_dim
    a_q = torch.randn(model.n_q_heads, d, dh, generator=generator) / math.sqrt(d)
    a_k = torch.randn(model.n_kv_heads, d, dh, generator=generator) / math.sqrt(d)
    return a_q, a_k


def _naive(a_q, a_k):
    g = a_q.shape[0] // a_k.shape[0]
    w_q = a_q.permute(1, 0, 2).reshape(a_q.shape[1], -1)                   # (d, n_q d_h)
    w_k = a_k.repeat_interleave(g, 0).permute(1, 0, 2).reshape(a_k.shape[1], -1)
    return torch.linalg.matrix_norm(w_q @ w_k.T, ord=2)                     # forms d×d


def bench_model(model, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    a_q, a_k = _layer(model, gen)
    u, v = spectral.init_power_state(model.n_q_heads, model.model_dim, model.model_dim,
                                     generator=gen)
    with torch.no_grad():
        spectral.per_head_power_step(a_q, a_k, u, v, iters=5)             # warm the state
        log.info("%s: power iteration", model.name)
        t_power = median_seconds(lambda: spectral.per_head_power_step(a_q, a_k, u, v),
                                 repeats=repeats * 10, warmup=2)
        log.info("%s: exact per head", model.name)
        t_exact = median_seconds(lambda: spectral.per_head_sigma_exact(a_q, a_k),
                                 repeats=repeats, warmup=1)
        log.info("%s: naive (form M, matrix_norm)", model.name)
        t_naive = median_seconds(lambda: _naive(a_q, a_k), repeats=max(1, repeats // 3),
                                 warmup=0)
    shape = (f"n_q={model.n_q_heads} n_kv={model.n_kv_heads} d={model.model_dim} "
             f"d_h={model.head_dim}")
    return [
        {"model": model.name, "shape": shape, "method": name, "seconds": t,
         "ratio_to_power": t / t_power}
        for name, t in (("power iteration (1 warm step, per head)", t_power),
                        ("exact per head (Gram + eigh, float64)", t_exact),
                        ("naive: form d×d M + matrix_norm", t_naive))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spectral", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (power: ×10)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rows = []
    for model in PAPER_MODELS:
        if model.name in MODELS:
            rows.extend(bench_model(model, args.repeats))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(tabulate([[r["model"], r["method"], f"{1e3 * r['seconds']:.2f}",
                     f"{r['ratio_to_power']:.1f}x"] for r in rows],
                   headers=["layer shape", "method", "ms", "vs power"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
