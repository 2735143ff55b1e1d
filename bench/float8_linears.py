"""``python -m bench.float8_linears``: geoscale's bound through torchao's FP8 training linears.

Needs the ``[float8]`` extra (torchao). Two tables:

1. **What the casts cost the bound.** Tiny Llama and Qwen2 (2 layers, hidden 64, seed 0)
   converted by ``convert_to_float8_training`` per recipe: each site's certified bound
   (the dequantized weight, the input cast's ``(1 + u')`` on ρ, its ball ``R_h``; the
   default norm-product RoPE bound) over the bound of the same model unconverted (plain
   ``nn.Linear``, the bound geoscale gave before). ``(1 + 2⁻⁴)² ≈ 1.129`` is the casts'
   factor alone; the rest is ``‖W̃‖`` against ``‖W‖`` and the output rounding.
2. **What it costs per step.** One layer's bound at Llama-3-8B shapes (d = 4096, 32:8 heads,
   d_h = 128, RoPE: the exact norm product) from the weights: plain projections against FP8
   ones (the weight programs of torchao's recipes replayed on 4096-wide weights, and the
   envelope's extra spectral norms), median of ``--repeats`` interleaved rounds in one process.

    python -m bench.float8_linears                       # ≈ 1 min on 2 cores
    python -m bench.float8_linears --repeats 9 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from tabulate import tabulate

import geoscale_fx
from geoscale_fx.numerics.estimators import ExactNormProduct
from geoscale_fx.numerics.head_weights import term_head_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from geoscale_fx.sites.terms import Rotary, Side, Source, Term

__all__ = ["RECIPES", "bound_ratios", "step_cost", "main"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128)


def _model(family: str, recipe: str | None):
    import transformers
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**SMALL)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if recipe is not None:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return model


def bound_ratios() -> list[list]:
    """Per family and recipe: the sites' bounds with FP8 linears over the plain model's."""
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    rows = []
    for family in ("Llama", "Qwen2"):
        plain = [site_logit_bound(s) for s in geoscale_fx.find_attention(
            _model(family, None), input_ids=ids)]
        for recipe in RECIPES:
            sites = geoscale_fx.find_attention(_model(family, recipe), input_ids=ids)
            ratios = [float((site_logit_bound(s) / p).max()) for s, p in zip(sites, plain)]
            rows.append([family, recipe, all(s.certified for s in sites),
                         " / ".join(f"{r:.3f}" for r in ratios)])
    return rows


def _layer_term(cast, d=4096, n_q=32, n_kv=8, d_h=128) -> Term:
    heads = lambda n: tuple(tuple(range(h * d_h, (h + 1) * d_h)) for h in range(n))  # noqa: E731
    rotary = Rotary("rotate_half", 1.0, True, tuple(range(d_h)), "cos", "sin")
    source = Source("rmsnorm", "norm", d, channel_ops=(("mul", "gain"),))
    q = Side(source, "wq", "dense", heads(n_q), rotary=rotary, cast=cast)
    k = Side(source, "wk", "dense", heads(n_kv), rotary=rotary, cast=cast)
    return Term(q, k)


def step_cost(repeats: int) -> list[list]:
    """Median ms of one layer's bound (weights → (A, c, envelope) → norm product)."""
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    casts = {"plain nn.Linear": None}
    for recipe in ("tensorwise", "rowwise"):
        site = geoscale_fx.find_attention(_model("Llama", recipe), input_ids=ids)[0]
        casts[f"FP8 {recipe}"] = site.terms[0].q.cast
    gen = torch.Generator().manual_seed(1)
    # the sides read ``W.t()`` of an (F, d) nn.Linear weight, as in a model's graph
    values = {"wq": torch.randn(4096, 4096, generator=gen).t() * 0.02,
              "wk": torch.randn(1024, 4096, generator=gen).t() * 0.02,
              "gain": 1 + 0.1 * torch.randn(4096, generator=gen)}
    terms = {name: _layer_term(cast) for name, cast in casts.items()}
    times: dict[str, list[float]] = {name: [] for name in terms}
    for _ in range(repeats):                      # interleaved rounds: same load for each
        for name, term in terms.items():
            estimator = ExactNormProduct(term, "", 128 ** -0.5)
            state = {s.name: torch.zeros(s.shape) for s in estimator.specs()}
            start = time.perf_counter()
            estimator.bound(term_head_weights(term, values.__getitem__), state)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain nn.Linear"])
    return [[name, 1e3 * statistics.median(t), statistics.median(t) / base]
            for name, t in times.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(tabulate(bound_ratios(), headers=["family", "recipe", "certified",
                                            "bound / plain bound (per site)"]))
    print()
    print(tabulate(step_cost(args.repeats), headers=["projections", "ms / layer", "× plain"],
                   floatfmt=".3g"))


if __name__ == "__main__":
    main()
