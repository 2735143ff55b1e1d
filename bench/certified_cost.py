"""``python -m bench.certified_cost``: what the certified bound costs per training step.

The default estimator (``estimator="schatten"``) bounds every head's σ from above at every
step with the Schatten-256 norm (seven squarings of d_h×d_h matrices, no eigensolver);
``"exact"`` solves two small eigenproblems per head every step; ``"power"`` is the paper's
warm power iteration, one step per call: a lower bound of σ once the weights move (not
certified). At RoPE sites the certified bound is the norm product ``‖A_q,h‖‖A_k,g‖``, each
norm bounded the same way. Two tables, every figure measured in this process:

1. **The zoo's training step**: the pretrained zoo GPT-2 (transformers' GPT2LMHeadModel,
   4 layers, d = 128, 4 heads), batch 8 × 128, AdamW, Inductor: plain ``torch.compile`` and
   geoscale with each estimator (certified every step or not, by ``report()``), in
   interleaved rounds (``bench.timing``); *ratio* is the median of the per-round ratios to
   plain, *spread* their range.
2. **The bound at three scales**: the zoo's layer, a 1B-like layer (Llama-3.2-1B's shapes)
   and a 7B-like layer (Llama-2-7B's). Per round, one decoder layer's training step (RMSNorm,
   q/k/v/o, causal SDPA, SwiGLU MLP; forward, backward and AdamW on ``--tokens`` tokens) and
   that layer's per-step bound by each route (the folded per-head weights, the bound, its
   state written), all compiled by Inductor; *share* is the median over rounds of
   bound / layer step — the layer count cancels (the ms columns multiply by it), and the
   embeddings and LM head a real step also runs are left out, so the share is overstated.

    python -m bench.certified_cost                          # both tables
    python -m bench.certified_cost --only step --rounds 12
    python -m bench.certified_cost --only scales --scales zoo 1B --rounds 3
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import geoscale_fx
from bench.timing import CLOCKS, interleaved
from geoscale_fx.core import spectral
from geoscale_fx.numerics.estimators import make_estimator
from geoscale_fx.sites.terms import HeadWeights, Rotary, Side, Source, Term

__all__ = ["SCALES", "ROUTES", "DecoderLayer", "zoo_step_table", "scale_table", "main"]

#: name -> (layers, d, query heads, kv heads, d_h, MLP width)
SCALES = {
    "zoo": (4, 128, 4, 4, 32, 512),
    "1B": (16, 2048, 32, 8, 64, 8192),
    "7B": (32, 4096, 32, 32, 128, 11008),
}
SCALE_NAMES = {"zoo": "zoo GPT-2 layer", "1B": "1B-like layer (Llama-3.2-1B)",
               "7B": "7B-like layer (Llama-2-7B)"}
#: route -> (estimator option, RoPE norm product); the power route is σ only
ROUTES = {
    "schatten σ (default)": ("schatten", False),
    "exact σ": ("exact", False),
    "power σ (not certified)": ("power", False),
    "schatten norm product (RoPE default)": ("schatten", True),
    "exact norm product (RoPE)": ("exact", True),
}
STEP_ESTIMATORS = ("schatten", "exact", "power")
PLAIN = "plain torch.compile"


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: RMSNorm, q/k/v/o (GQA), causal SDPA, RMSNorm, SwiGLU MLP."""

    def __init__(self, d: int, n_q: int, n_kv: int, d_h: int, mlp: int):
        super().__init__()
        self.shape = (n_q, n_kv, d_h)
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q = nn.Linear(d, n_q * d_h, bias=False)
        self.k = nn.Linear(d, n_kv * d_h, bias=False)
        self.v = nn.Linear(d, n_kv * d_h, bias=False)
        self.o = nn.Linear(n_q * d_h, d, bias=False)
        self.gate = nn.Linear(d, mlp, bias=False)
        self.up = nn.Linear(d, mlp, bias=False)
        self.down = nn.Linear(mlp, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (b, t, _), (n_q, n_kv, d_h) = x.shape, self.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, n_q, d_h).transpose(1, 2)            # (B, n_q, T, d_h)
        k = self.k(h).view(b, t, n_kv, d_h).transpose(1, 2)           # (B, n_kv, T, d_h)
        v = self.v(h).view(b, t, n_kv, d_h).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_q != n_kv)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, n_q * d_h))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


# --------------------------------------------------------------------------------------
# Table 1: the zoo's training step
# --------------------------------------------------------------------------------------

def zoo_step_table(rounds: int, repeats: int, clock: str = "wall", seed: int = 0
                   ) -> list[dict]:
    """Plain ``torch.compile`` and geoscale with each estimator, one training step each."""
    from bench.lms import pretrained_lm

    lm = pretrained_lm("gpt2")
    batch = lm.batch(torch.Generator().manual_seed(seed), 8, 128, "train")
    steps, compile_s, models = {}, {}, {}
    for estimator in (None, *STEP_ESTIMATORS):
        name = PLAIN if estimator is None else f"geoscale, estimator={estimator!r}"
        model = lm.build()
        compiled = (torch.compile(model) if estimator is None else
                    geoscale_fx.wrap(model, compiler="inductor", estimator=estimator))
        steps[name], models[name] = lm.train_step(model, compiled, batch, lr=1e-4), compiled
        start = time.perf_counter()
        steps[name]()
        compile_s[name] = time.perf_counter() - start
    timings = interleaved(steps, base=PLAIN, rounds=rounds, repeats=repeats, clock=clock)
    rows = []
    for name in steps:
        stat = timings.ratio(name)
        report = None if name == PLAIN else geoscale_fx.report(models[name]).rows
        rows.append({"training step": name, "first call s": compile_s[name],
                     "ms": timings.median_ms(name), "ratio to plain": stat.median,
                     "spread": f"{stat.lo:.3f}-{stat.hi:.3f}",
                     "certified now": "" if report is None else
                     all(r["certified"] for r in report)})
    return rows


# --------------------------------------------------------------------------------------
# Table 2: the bound at three scales
# --------------------------------------------------------------------------------------

def _compile(fn, backend: str, **kwargs):
    """``torch.compile`` by Inductor; ``"eager"``: the function itself, not traced."""
    return fn if backend == "eager" else torch.compile(fn, backend=backend, **kwargs)


def _term(d: int, n_q: int, n_kv: int, d_h: int, rope: bool) -> Term:
    half = d_h // 2
    rotary = Rotary("rotate_half", 1.0, True, tuple((j + half) % d_h for j in range(d_h)),
                    "cos", "sin") if rope else None

    def side(n):
        heads = tuple(tuple(range(h * d_h, (h + 1) * d_h)) for h in range(n))
        return Side(Source("rmsnorm", "norm", d), "w", "linear", heads, rotary=rotary)
    return Term(side(n_q), side(n_kv))


def _bound_step(layer: DecoderLayer, route: str, backend: str):
    """The per-step bound of ``layer``'s attention by ``route``, compiled: a callable."""
    estimator, rope = ROUTES[route]
    n_q, n_kv, d_h = layer.shape
    d = layer.q.weight.shape[1]
    est = make_estimator(_term(d, n_q, n_kv, d_h, rope), 0, d_h ** -0.5, granularity="head",
                         estimator=estimator, rope_bound="norm_product")
    state = {s.name: torch.zeros(s.shape) for s in est.specs()}
    for name in ("u", "v"):      # the power route's warm vectors (any unit vectors time alike)
        if name in state:
            state[name].copy_(F.normalize(torch.randn(state[name].shape), dim=-1))

    def bound(gain, w_q, w_k):
        a_q, _ = spectral.fold_affine(spectral.split_heads(w_q, n_q), gain)
        a_k, _ = spectral.fold_affine(spectral.split_heads(w_k, n_kv), gain)
        return est.full_step(HeadWeights(a_q, None, a_k, None), state)

    compiled = _compile(bound, backend, fullgraph=True)
    # detached, as geoscale's nodes read the weight placeholders in the training graph
    args = (layer.norm1.weight.detach(), layer.q.weight.detach(), layer.k.weight.detach())
    return lambda: compiled(*args)


def _layer_step(layer: DecoderLayer, tokens: int, backend: str):
    batch = 8 if tokens % 8 == 0 and tokens // 8 <= 512 else 1
    x = torch.randn(batch, tokens // batch, layer.q.weight.shape[1])
    compiled = _compile(layer, backend)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-5)

    def step():
        opt.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()
        opt.step()
    return step


def scale_table(scales: list[str], tokens: int, rounds: int, repeats: int,
                clock: str = "wall", backend: str = "inductor") -> list[dict]:
    """Every route's bound as a share of one layer's training step, per scale."""
    rows = []
    for key in scales:
        layers, d, n_q, n_kv, d_h, mlp = SCALES[key]
        torch._dynamo.reset()      # one bound function's code, recompiled per route and scale
        torch.manual_seed(0)
        layer = DecoderLayer(d, n_q, n_kv, d_h, mlp)
        with torch.no_grad():      # trained gains are not all ones
            layer.norm1.weight.uniform_(0.5, 1.5)
        fns = {"layer step": _layer_step(layer, tokens, backend)}
        fns.update({route: _bound_step(layer, route, backend) for route in ROUTES})
        for fn in fns.values():
            fn()                                         # compiles
        timings = interleaved(fns, base="layer step", rounds=rounds, repeats=repeats,
                              clock=clock)
        step_ms = timings.median_ms("layer step")
        for route in ROUTES:
            stat = timings.ratio(route)
            rows.append({"scale": SCALE_NAMES[key], "layers": layers, "route": route,
                         "bound ms / layer": timings.median_ms(route),
                         "bound ms / step": layers * timings.median_ms(route),
                         f"step ms ({tokens} tokens)": layers * step_ms,
                         "share of a step": stat.median,
                         "spread": f"{stat.lo:.2%}-{stat.hi:.2%}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.certified_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("step", "scales"), nargs="+",
                        default=["step", "scales"])
    parser.add_argument("--scales", nargs="+", choices=list(SCALES), default=list(SCALES))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default: 12 for the step, 3 for scales)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compiler", choices=("inductor", "eager"), default="inductor",
                        help="the scales table's compiler (eager: a quick check of the script)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="cpu: this process's CPU time (with --threads 1 on a shared "
                        "machine, other processes' load barely moves it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock")
    if "step" in args.only:
        rows = zoo_step_table(args.rounds or 12, args.repeats, args.clock)
        print(tabulate(rows, headers="keys", floatfmt=".3f"))
    if "scales" in args.only:
        for scale in args.scales:          # each table as soon as it is measured
            rows = scale_table([scale], args.tokens, args.rounds or 3, args.repeats,
                               args.clock, args.compiler)
            print(tabulate(rows, headers="keys", floatfmt=".4g"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
