"""The ``geoscale`` command line: ``geoscale bounds``, ``geoscale inspect`` and
``geoscale export-kv-scales``."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from tabulate import tabulate

from geoscale_fx.api import inspection
from geoscale_fx.core.errors import CheckpointError
from geoscale_fx.export.kv_scales import WRITERS, export_kv_scales
from geoscale_fx.testing.paper_models import PAPER_MODELS, calibration_row

__all__ = ["main"]


def _bounds_table(args: argparse.Namespace) -> str:
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


def _load_for_export(args: argparse.Namespace):
    """``(model, example inputs)`` of what ``geoscale inspect`` loads
    (``package.module:function``, e.g. ``models_zoo.inspection:hf-llama`` from a checkout);
    a saved directory is never loaded (see ``_export_kv_scales``)."""
    loaded = inspection.load_model(args.model, seq_len=args.seq_len)
    return loaded.model, loaded.inputs


def _export_table(export) -> str:
    """One row per attention module: its k/v/q scales (max over heads, and min if per head)."""
    rows: dict[str, dict] = {}
    for name, scale in export.tensors.items():
        site, kind = name.rsplit(".", 1)
        cell = f"{float(scale.max()):.4g}"
        if scale.numel() > 1:
            cell = f"{float(scale.min()):.4g}..{cell} ({scale.numel()})"
        rows.setdefault(site, {"attention": site})[kind] = cell
    return tabulate(list(rows.values()), headers="keys")


def _left_at_default(export) -> list[str]:
    """One line per cache layer left out of the file, with why and what would bound it."""
    if not export.left_at_default:
        return []
    return [f"\n{len(export.left_at_default)} left without scales (a serving engine uses its "
            "default scale for them, 1.0 in vLLM; --all-or-nothing refuses instead):",
            *(f"  {refusal.describe()}" for refusal in export.left_at_default.values())]


def _export_source(spec: str) -> str:
    """``"directory"`` (a saved checkpoint, streamed) or ``"callable"``
    (``package.module:function``); anything else is a ``CheckpointError`` naming it."""
    if os.path.isdir(spec):
        return "directory"
    if ":" in spec and not os.path.exists(spec):
        return "callable"
    what = "is not a directory" if os.path.exists(spec) else "does not exist"
    raise CheckpointError(f"{spec} {what} (export-kv-scales takes a saved Hugging Face model "
                          "directory, or package.module:function with --out)")


def _export_kv_scales(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    options = dict(strategy=args.strategy, include_q=not args.no_q,
                   all_or_nothing=args.all_or_nothing, format=args.format)
    try:
        if _export_source(args.model) == "directory":   # traced weightless, weights streamed
            export = export_kv_scales(args.model, args.out, **options)
        else:
            if args.out is None:
                raise SystemExit("geoscale export-kv-scales: --out DIR is needed for a model "
                                 "that is not a saved directory")
            model, inputs = _load_for_export(args)
            export = export_kv_scales(model, args.out, **options, **inputs)
    except ValueError as exc:      # CheckpointError among them: names the file
        print(f"geoscale export-kv-scales: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:         # what no check foresaw: still one line, naming the file
        print(f"geoscale export-kv-scales: {exc.filename or args.model}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    print(_export_table(export))
    for line in _left_at_default(export):
        print(line)
    print(f"\n{len(export.tensors)} tensors ({args.strategy}) in "
          + ", ".join(str(f) for f in export.files)
          + ("; merged into the checkpoint" if export.merged else ""))
    return 0


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
    sub.add_parser("inspect", help="which attentions of a model geoscale scales, why not, and "
                                   "their bounds: a saved directory, a config.json (meta "
                                   "device) or --model-type (see geoscale inspect -h)",
                   add_help=False)
    e = sub.add_parser("export-kv-scales",
                       help="FP8 KV-cache scales from the weights, as a compressed-tensors "
                            "checkpoint (vLLM, SGLang) holds them")
    e.add_argument("model", help="a saved Hugging Face model directory (never loaded: traced "
                                 "without its weights, only the attention weights read, layer "
                                 "by layer; the scales are merged into it unless --out), a "
                                 "models_zoo name or package.module:function")
    e.add_argument("--out", help="output directory (default: the model directory)")
    e.add_argument("--strategy", choices=("tensor", "head"), default="tensor",
                   help="one scale per layer (default) or one per head (attn_head)")
    e.add_argument("--seq-len", type=int, default=8,
                   help="length of the example prompt traced once (default 8; a saved "
                        "directory is traced without its weights on 8 tokens)")
    e.add_argument("--size", choices=("small", "full"), default="small",
                   help="models_zoo paper architectures: scaled-down or full size")
    e.add_argument("--no-q", action="store_true", help="write k_scale/v_scale only")
    e.add_argument("--format", choices=sorted(WRITERS), default="compressed-tensors",
                   help="what the scales are written as (default compressed-tensors: what "
                        "vLLM and SGLang load)")
    e.add_argument("--all-or-nothing", action="store_true",
                   help="refuse the export (exit 2, nothing written) if any cache layer "
                        "cannot be bounded from the weights; by default such a layer is "
                        "left out, named, and the others are written")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["inspect"]:
        return inspection.main(argv[1:])
    args = _build_parser().parse_args(argv)
    if args.command == "export-kv-scales":
        return _export_kv_scales(args)
    if args.command == "bounds":
        try:
            print(_bounds_table(args))
        except ValueError as exc:
            print(f"geoscale bounds: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
