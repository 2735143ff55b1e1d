"""``python -m geoscale_fx.inspection MODEL`` / ``geoscale inspect MODEL``: a model's attention sites.

``MODEL`` is a name from the repository's ``models_zoo`` (run from a checkout, e.g.
``nanogpt``, ``hf-llama``, ``minilm``, ``llama-2-70b --size full``) or ``package.module:fn``,
a callable returning an ``nn.Module`` with a Hugging Face ``config`` (it is fed random token
ids). Prints one row per site: where it is, what the analysis found, whether its bound is
certified, and why a site was left alone.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
from tabulate import tabulate

from geoscale_fx.capture import find_attention
from geoscale_fx.passes.site_model import ROPE_BOUNDS, AttentionSite

__all__ = ["site_rows", "main"]


def site_rows(sites: list[AttentionSite], with_bounds: bool = True) -> list[dict]:
    """One plain dict per site (what ``inspect`` prints)."""
    rows = []
    for s in sites:
        row = {"#": s.index, "site": s.name, "kind": s.kind, "supported": s.supported}
        if s.supported:
            bound = s.logit_bound() if with_bounds else None
            row.update({
                "heads q/kv": f"{s.n_q_heads}/{s.n_kv_heads}", "d": s.model_dim,
                "d_h": s.head_dim, "norm": s.norm, "rope": s.rope,
                "bias": s.q.bias is not None or s.k.bias is not None,
                "scale": round(s.softmax_scale, 5), "certified": s.certified,
                "max bound": None if bound is None or bound.device.type == "meta"
                else round(float(bound.max()), 3),
            })
        row["reason"] = s.reason
        rows.append(row)
    return rows


def _load(spec: str, size: str, attn_impl: str, batch: int, seq_len: int):
    if ":" in spec:
        module_name, fn_name = spec.split(":", 1)
        model = getattr(importlib.import_module(module_name), fn_name)()
        vocab = model.config.vocab_size
        device = next(model.parameters()).device
        return model.eval(), {"input_ids": torch.randint(0, vocab, (batch, seq_len),
                                                         device=device)}
    if os.path.isdir("models_zoo") and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script does not put the checkout first
    try:
        import models_zoo
    except ImportError:
        raise SystemExit("geoscale inspect: models_zoo is a repository tool; run from a "
                         "checkout of geoscale-fx, or pass package.module:function")
    kwargs = {"size": size} if spec in ("gpt2-xl", "mistral-7b", "llama-2-13b",
                                        "llama-2-70b") else {}
    zoo = models_zoo.get(spec, attn_implementation=attn_impl, **kwargs)
    inputs = zoo.example_inputs(batch=batch, seq_len=seq_len)
    if zoo.family in ("gpt2", "llama", "mistral"):
        inputs["use_cache"] = False
    return zoo.model, inputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="geoscale inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="models_zoo name or package.module:function")
    parser.add_argument("--size", choices=("small", "full"), default="small",
                        help="paper architectures: scaled-down (default) or full size (meta)")
    parser.add_argument("--attn-impl", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--rope-bound", choices=ROPE_BOUNDS, default="norm_product")
    args = parser.parse_args(argv)
    model, inputs = _load(args.model, args.size, args.attn_impl, args.batch, args.seq_len)
    sites = [s.with_rope_bound(args.rope_bound) if s.supported else s
             for s in find_attention(model, **inputs)]
    if not sites:
        print(f"{args.model}: no attention found")
        return 0
    rows = site_rows(sites)
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0].keys()))
          if all(r.keys() == rows[0].keys() for r in rows)
          else tabulate(rows, headers="keys"))
    n_ok = sum(s.supported for s in sites)
    print(f"\n{len(sites)} attention sites, {n_ok} supported, "
          f"{sum(s.certified for s in sites)} with a certified bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
