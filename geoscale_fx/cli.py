"""The ``geoscale`` command line: ``geoscale bounds`` and ``geoscale inspect``."""
from __future__ import annotations

import argparse
import sys

from tabulate import tabulate

__all__ = ["main"]


def _bounds_table(args: argparse.Namespace) -> str:
    from geoscale_fx.paper_models import PAPER_MODELS, calibration_row

    custom = [args.d, args.dh, args.layers, args.heads]
    if any(v is not None for v in custom):
        if any(v is None for v in custom):
            raise SystemExit("geoscale bounds: --d, --dh, --layers and --heads go together")
        row = calibration_row(args.name, args.d, args.dh, args.layers * args.heads,
                              args.seq_len, args.delta)
        rows = [[row["model"], row["d"], row["d_h"], row["N"], row["L"], f"{row['delta']:g}",
                 f"{row['gamma']:.3f}", f"{row['improvement']:.1f}x", f"{row['alpha_min']:.4f}",
                 f"{row['overflow_prob_bound']:.2e}"]]
        headers = ["model", "d", "d_h", "N", "L", "δ*", "γ", "d/(γ d_h)", "α_min",
                   "N(T1+T2) at α_min"]
        return tabulate(rows, headers=headers)
    rows = []
    for m in PAPER_MODELS:
        row = calibration_row(m.name, m.model_dim, m.head_dim, m.n_heads_total,
                              args.seq_len, args.delta)
        rows.append([m.name, m.model_dim, m.head_dim, row["N"], row["L"], f"{row['delta']:g}",
                     f"{row['gamma']:.3f}", m.printed_gamma,
                     f"{row['improvement']:.1f}x", f"{m.printed_improvement}x",
                     f"{row['alpha_min']:.4f}", m.printed_alpha_min])
    headers = ["model", "d", "d_h", "N", "L", "δ*", "γ", "γ (paper)", "d/(γ d_h)",
               "(paper)", "α_min", "α_min (paper)"]
    return tabulate(rows, headers=headers)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geoscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bounds", help="γ, rank-aware improvement and α_min (paper Tables 2-3)")
    b.add_argument("--d", type=int, help="model width d")
    b.add_argument("--dh", type=int, help="head width d_h")
    b.add_argument("--layers", type=int, help="number of layers")
    b.add_argument("--heads", type=int, help="query heads per layer")
    b.add_argument("--seq-len", type=int, default=1024, help="sequence length L (default 1024)")
    b.add_argument("--delta", type=float, default=1e-6, help="target failure probability δ*")
    b.add_argument("--name", default="custom", help="row label for a custom architecture")
    sub.add_parser("inspect", help="attention sites of a model (see geoscale inspect -h)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["inspect"]:
        from geoscale_fx.inspection import main as inspect_main

        return inspect_main(argv[1:])
    args = _build_parser().parse_args(argv)
    if args.command == "bounds":
        try:
            print(_bounds_table(args))
        except ValueError as exc:
            print(f"geoscale bounds: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
