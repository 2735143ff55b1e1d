"""How far rounding puts certified bounds under their float64 value.

For ``--blocks`` seeded attention blocks (``tests.attention_variants.Block``: LayerNorm with
random gain and offset, q/k/v projections with biases, 4 heads of 16, d = 64), the library's
bounds on the float32 block are compared with the same library on a float64 copy of it (every
fold, sum and norm then in float64), per head:

* ``logit``: ``site_logit_bound`` (the exact route of the logit bound);
* ``q/k/v entry``: ``site_amax_bounds`` (what the q/k/v descales and KV-cache scales come from);
* ``scale B/448``: ``round_up_f32(entry bound / 448)``, the exported scale, against the
  float64 ``B/448``.

A row counts the heads whose float32-path value is below the float64 one by more than
float64 rounding (2⁻³⁶ relative) and the largest shortfall. Run
``python -m bench.fold_rounding [--blocks 20]``; on the commit before the float64 fold of
``numerics.amax`` the entry rows show what the float32 fold lost.
"""
from __future__ import annotations

import argparse
import copy

import torch
from tabulate import tabulate

import geoscale_fx
from geoscale_fx.core.bounds import round_up_f32
from geoscale_fx.numerics.amax import site_amax_bounds
from geoscale_fx.numerics.logit_bounds import site_logit_bound

SLACK = 2.0 ** -36


def _bounds(model, x) -> dict[str, torch.Tensor]:
    site, = geoscale_fx.find_attention(model, x)
    entry = torch.cat(list(site_amax_bounds(site).values()))
    return {"logit": site_logit_bound(site), "q/k/v entry": entry, "scale B/448": entry / 448}


def measure(blocks: int) -> list[dict]:
    from tests.attention_variants import Block

    found = {}
    for seed in range(blocks):
        torch.manual_seed(seed)
        block = Block(layout="separate", qk_bias=True).eval()
        with torch.no_grad():
            block.norm.weight.uniform_(0.5, 2.0)
            block.norm.bias.normal_()
        x = torch.randn(1, 6, 64)
        ours, exact = _bounds(block, x), _bounds(copy.deepcopy(block).double(), x.double())
        ours["scale B/448"] = round_up_f32(ours["scale B/448"])
        for name, value in ours.items():
            short = (exact[name] - value.double()) / exact[name]
            below, worst, heads = found.get(name, (0, 0.0, 0))
            found[name] = (below + int((short > SLACK).sum()),
                           max(worst, float(short.max())), heads + short.numel())
    return [{"bound": name, "heads": heads, "below float64": below,
             "largest shortfall (relative)": f"{worst:.2g}" if worst > SLACK else "none"}
            for name, (below, worst, heads) in found.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fold_rounding", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20)
    args = parser.parse_args(argv)
    print(tabulate(measure(args.blocks), headers="keys", tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
