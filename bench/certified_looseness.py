"""``python -m bench.certified_looseness``: how far above the exact values the default bounds are.

The default estimator (``estimator="schatten"``) bounds every head's ``σ_h = ‖A_q,h A_k,gᵀ‖₂``
and, at RoPE sites, ``‖A_q,h‖₂`` and ``‖A_k,g‖₂`` from above (``geoscale_fx.core.schatten``,
at most ``rank^{1/256}`` above them). Here the zoo's two pretrained LMs (byte-level GPT-2 and
Llama of ``models_zoo``, 4 layers, d = 128, 4 heads) are fine-tuned with AdamW (plain
PyTorch, eager) and at every step, from the checkpoint on, each head's bound is divided by
the exact value (float64 eigensolvers, ``geoscale_fx.core.spectral``); the same for freshly
initialized (random) weights. *excess* is ``bound / exact − 1`` over all steps, sites and
heads: its median and its worst. The last column is what an amortized alternative would add
each step: Weyl's drift bound ``‖ΔA_q‖_F (‖A_k‖₂ + ‖ΔA_k‖_F) + ‖A_q‖₂ ‖ΔA_k‖_F`` of one
step's update over σ (spectral norms bounded by Frobenius norms, as a cheap per-step
certificate must).

    python -m bench.certified_looseness                    # 40 steps at lr 3e-4, both LMs
    python -m bench.certified_looseness --steps 100 --lr 1e-3 --families gpt2
"""
from __future__ import annotations

import argparse
import statistics

import torch
from tabulate import tabulate

import geoscale_fx
from geoscale_fx.core import schatten, spectral
from geoscale_fx.numerics.head_weights import site_term_weights

__all__ = ["measure", "main"]


def _heads(sites) -> list:
    """``(a_q, a_k)`` of every site's first term, float64 copies of the current weights."""
    return [tuple(t.detach().double().clone() for t in (hw.a_q, hw.a_k))
            for hw in (site_term_weights(s)[0] for s in sites)]


def _excess(heads) -> dict[str, list[float]]:
    out = {"σ": [], "‖A‖ (RoPE norm product)": []}
    for a_q, a_k in heads:
        sigma = spectral.per_head_sigma_exact(a_q, a_k)
        out["σ"] += (schatten.per_head_sigma(a_q, a_k) / sigma - 1).tolist()
        for a in (a_q, a_k):
            norms = spectral.head_spectral_norms(a)
            out["‖A‖ (RoPE norm product)"] += (schatten.head_norms(a) / norms - 1).tolist()
    return out


def _weyl_slack(before, after) -> list[float]:
    """One step's Weyl drift bound over σ (after the step), per head."""
    slack = []
    for (q0, k0), (q1, k1) in zip(before, after):
        group = q0.shape[0] // k0.shape[0]
        dq = torch.linalg.matrix_norm(q1 - q0)                       # Frobenius
        dk = torch.linalg.matrix_norm(k1 - k0).repeat_interleave(group)
        nq, nk = spectral.head_spectral_norms(q0), spectral.head_spectral_norms(k0)
        drift = dq * (nk.repeat_interleave(group) + dk) + nq * dk
        slack += (drift / spectral.per_head_sigma_exact(q1, k1)).tolist()
    return slack


def measure(family: str, steps: int, lr: float, seed: int = 0) -> list[dict]:
    """Rows for one zoo LM: random weights, then the checkpoint fine-tuned ``steps`` steps."""
    from bench.lms import pretrained_lm

    lm = pretrained_lm(family)
    gen = torch.Generator().manual_seed(seed)
    batch = lm.batch(gen, 8, 128, "train")
    model = lm.build()
    torch.manual_seed(seed)
    fresh = type(model)(model.config)                       # random initialization
    rows = []
    random = _excess(_heads(geoscale_fx.find_attention(fresh.eval(), **batch)))
    sites = geoscale_fx.find_attention(model, **batch)     # bound to the live parameters
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    trained, slack, heads = {k: [] for k in random}, [], _heads(sites)
    for step in range(steps + 1):
        for key, values in _excess(heads).items():
            trained[key] += values
        if step == steps:
            break
        opt.zero_grad(set_to_none=True)
        lm.loss(model, lm.batch(gen, 8, 128, "train")).backward()
        opt.step()
        after = _heads(sites)
        slack += _weyl_slack(heads, after)
        heads = after
    for weights, excess in (("random", random), (f"fine-tuned, {steps} steps", trained)):
        for route, values in excess.items():
            rows.append({"model": lm.name, "weights": weights, "bound of": route,
                         "heads × steps": len(values),
                         "excess median": statistics.median(values),
                         "excess worst": max(values), "below exact": sum(v < 0 for v in values),
                         "Weyl slack / step (median, worst)":
                         "" if weights == "random" or route != "σ" else
                         f"{statistics.median(slack):.2%}, {max(slack):.2%}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.certified_looseness",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=("gpt2", "llama"),
                        default=["gpt2", "llama"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args(argv)
    rows = [r for family in args.families for r in measure(family, args.steps, args.lr)]
    print(f"AdamW lr {args.lr}, batch 8 × 128; excess = bound / exact − 1")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
