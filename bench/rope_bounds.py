"""Which RoPE logit bound is tighter, at what cost (certified vs the paper's).

For every attention of a RoPE model this compares, per head:

* ``norm_product``  (ρ‖A_q‖ + ‖c_q‖)(ρ‖A_k‖ + ‖c_k‖)·s — certified, our default;
* ``relative``      max over relative positions δ of the affine bound with A_q T_δ A_kᵀ —
                    certified and exact for the rotation, O(L·d_h³) per head;
* ``interaction``   the paper's ‖A_q A_kᵀ‖ ignoring the rotation — not a proof;

against the largest logit actually observed on real text. Run ``python -m bench.rope_bounds``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import geoscale_fx
from geoscale_fx.numerics.logit_bounds import site_logit_bound

BOUNDS = ("interaction", "relative", "norm_product")


def measure(family: str, seq_len: int, profile: str) -> list[dict]:
    from bench.lms import pretrained_lm

    lm = pretrained_lm(family, profile)
    model = lm.build()
    batch = lm.batch(torch.Generator().manual_seed(0), 4, seq_len, "val")
    batch.pop("labels", None)
    sites = [s for s in geoscale_fx.find_attention(model, **batch) if s.supported]
    # observed max|S| per head: an audit (α = 1 leaves FP8 rounding of ~1e-3 upstream)
    wrapped = geoscale_fx.wrap(lm.build(), compiler="aot_eager", audit=True)
    with torch.no_grad():
        wrapped(**batch)
    observed = [r.state.amax.double() for r in wrapped.geoscale.records.values()]
    rows = []
    for name in BOUNDS:
        ratios, seconds = [], []
        for site, obs in zip(sites, observed):
            start = time.perf_counter()
            bound = site_logit_bound(site, rope_bound=name)
            seconds.append(time.perf_counter() - start)
            ratios.extend((obs / bound).tolist())
        rows.append({"model": lm.name, "L": seq_len, "bound": name,
                     "certified": name != "interaction",
                     "median observed/bound": statistics.median(ratios),
                     "max observed/bound": max(ratios),
                     "ms per layer": 1e3 * statistics.mean(seconds)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rope_bounds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--full", action="store_true", help="the full-profile pretrained LM")
    args = parser.parse_args(argv)
    rows = [r for length in args.seq_len
            for r in measure("llama", length, "full" if args.full else "quick")]
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
