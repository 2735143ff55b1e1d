"""``geoscale inspect``: which attentions of a model geoscale scales, why not, and their bounds.

Three forms, for Hugging Face models::

    geoscale inspect ./saved-model              # config.json + weights: loaded, bounds from them
    geoscale inspect ./saved-model/config.json  # (or a directory with config.json only): built
                                                # on the meta device, no weight read; bounds "—"
    geoscale inspect --model-type qwen2         # the family's default config shrunk
                                                # (geoscale_fx.testing.hf_configs), random weights

and ``package.module:function``: a callable returning an ``nn.Module`` (fed random token ids
below its vocabulary) or ``(module, inputs)`` with ``inputs`` the keyword arguments of a call;
the current directory is importable, as for ``python -m``. From a checkout, the repository's
zoo: ``geoscale inspect models_zoo.inspection:hf-llama``, or ``python -m models_zoo.inspection
NAME`` (also ``--size full``).

One row per attention site, in forward order: where it is, what the analysis found, and for a
supported site with weights σ = max_h ‖A_q,h A_k,g(h)ᵀ‖₂ (unrotated), "bound" = max_h of its
bound on |S| (``logit_bounds.site_logit_bound(site)``, with ``--rope-bound``) and whether that
bound is certified; a site left alone says why in "reason".

Example::

    >>> from geoscale_fx.api.inspection import load_model, sites_report
    >>> loaded = load_model("./saved-model/config.json")       # meta device
    >>> print(sites_report(loaded.model, loaded.inputs))
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate

from geoscale_fx.numerics import head_weights, logit_bounds
from geoscale_fx.testing import hf_configs
from geoscale_fx.core import spectral
from geoscale_fx.analysis.capture import find_attention
from geoscale_fx.testing.hf_configs import token_inputs
from geoscale_fx.planning.plan import runnable
from geoscale_fx.sites.model import ROPE_BOUNDS, AttentionSite

__all__ = ["LoadedModel", "load_model", "load_model_type", "site_rows", "sites_report", "main"]

NO_WEIGHTS = "—"      # a bound column of a model without weights (meta device)
PER_CALL = "per call"   # the bound of a site bounded by its measured q and k
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


@dataclass
class LoadedModel:
    """A model to inspect and the keyword arguments of one call of it."""
    model: torch.nn.Module
    inputs: dict
    source: str                      # what it was built from, for the report's first line


def _import_callable(spec: str):
    """``package.module:attribute`` (any attribute name, ``models_zoo.inspection:hf-llama``),
    importing with the current directory on the path."""
    module_name, attribute = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise           # the module exists and fails an import of its own
        raise ValueError(f"{spec}: no module {exc.name!r} here ({os.getcwd()}) nor installed"
                         ) from None
    finally:
        sys.path.remove(os.getcwd())
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"{spec}: module {module_name!r} has no {attribute!r}") from None


def _load_hf(path: Path, batch: int, seq_len: int, attn_implementation: str | None):
    from transformers import AutoConfig

    directory = path.parent if path.is_file() else path
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    config = AutoConfig.from_pretrained(directory)
    weights = path.is_dir() and any(any(path.glob(p)) for p in _WEIGHT_FILES)
    if weights:
        model = hf_configs.auto_model_class(config).from_pretrained(directory, **kwargs).eval()
        source = f"{path} ({type(model).__name__}, weights loaded)"
    else:
        model = hf_configs.model_from_config(config, device="meta", **kwargs)
        source = f"{path} ({type(model).__name__} on the meta device: no weights read)"
    return LoadedModel(model, token_inputs(model, batch, seq_len), source)


def load_model(spec: str, *, batch: int = 1, seq_len: int = 32,
               attn_implementation: str | None = None) -> LoadedModel:
    """The model ``spec`` names, and example inputs for one call.

    ``spec``: a saved Hugging Face model directory (config.json + weights; loaded with its
    saved architecture, else ``AutoModelForCausalLM``, else ``AutoModel``), a ``config.json``
    or a directory holding only one (built on the meta device: nothing is allocated or
    read), or ``package.module:function`` (see the module docstring). ``attn_implementation``
    ("sdpa", "eager" …) applies to Hugging Face models only. Raises ``ValueError`` saying
    what ``spec`` should be when it is none of these.
    """
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file() or path.is_file() \
            and path.suffix == ".json":
        return _load_hf(path, batch, seq_len, attn_implementation)
    if "/" in spec or os.sep in spec or path.suffix == ".json" or path.exists():
        what = "no config.json in it" if path.is_dir() else "no such directory or config.json"
        raise ValueError(f"{spec!r}: {what}")
    if ":" not in spec:
        raise ValueError(f"{spec!r}: not a saved model directory, a config.json or "
                         "package.module:function (a models_zoo name, from a checkout: "
                         f"models_zoo.inspection:{spec}; a transformers model type: "
                         "geoscale inspect --model-type NAME)")
    if attn_implementation is not None:
        raise ValueError(f"attn_implementation={attn_implementation!r} applies to Hugging Face "
                         "models (a directory, a config.json, --model-type), not to "
                         f"{spec}")
    built = _import_callable(spec)()
    if isinstance(built, tuple):
        model, inputs = built
        return LoadedModel(model.eval(), dict(inputs), spec)
    return LoadedModel(built.eval(), token_inputs(built, batch, seq_len), spec)


def load_model_type(model_type: str, *, batch: int = 1, seq_len: int = 32,
                    attn_implementation: str | None = None) -> LoadedModel:
    """A random-weight model of transformers ``model_type``, its default config shrunk
    (:func:`geoscale_fx.testing.hf_configs.tiny_model`); ``ValueError`` naming a type that cannot be
    built, and why."""
    model = hf_configs.tiny_model(model_type, attn_implementation=attn_implementation)
    source = (f"--model-type {model_type} ({type(model).__name__}, shrunk default config, "
              f"random weights)")
    return LoadedModel(model, token_inputs(model, batch, seq_len), source)


def _sigma(site: AttentionSite) -> float:
    """max_h σ_h over the site's terms, σ_h = ‖A_q,h A_k,g(h)ᵀ‖₂ of the weights as they are."""
    return max(float(spectral.per_head_sigma_exact(hw.a_q, hw.a_k).max())
               for hw in head_weights.site_term_weights(site))


def _bound_columns(site: AttentionSite, with_bounds: bool) -> dict:
    if not site.supported:
        return {"σ": None, "bound": None, "certified": None}
    if site.bound_by == "measured":
        return {"σ": None, "bound": PER_CALL, "certified": site.certified}
    if not with_bounds:
        return {"σ": NO_WEIGHTS, "bound": NO_WEIGHTS, "certified": NO_WEIGHTS}
    bound = float(logit_bounds.site_logit_bound(site).max())
    return {"σ": f"{_sigma(site):.4g}", "bound": f"{bound:.4g}", "certified": site.certified}


def site_rows(sites: list[AttentionSite], with_bounds: bool = True) -> list[dict]:
    """One plain dict per site, every site with the same keys (what ``inspect`` prints);
    ``with_bounds=False`` for a model without weights: σ, bound and certified are "—"."""
    rows = []
    for s in sites:
        shape = s.supported
        rows.append({
            "#": s.index, "site": s.name, "kind": s.kind, "supported": s.supported,
            "heads q/kv": f"{s.n_q_heads}/{s.n_kv_heads}" if shape else None,
            "d": s.model_dim if shape and s.bound_by == "weights" else None, "d_h": s.head_dim if shape else None,
            "norm": s.norm if shape else None, "rope": s.rope if shape else None,
            "bias": any(t.q.bias is not None or t.k.bias is not None for t in s.terms)
            if shape else None,
            "scale": f"{s.softmax_scale:.4g}" if shape else None,
            **_bound_columns(s, with_bounds),
            "reason": s.reason or (f"measured: {s.unbounded_reason}" if s.unbounded_reason
                                   else ""),
        })
    return rows


def sites_report(model: torch.nn.Module, inputs: dict, rope_bound: str = "norm_product") -> str:
    """The table of :func:`site_rows` for one call ``model(**inputs)``, and a summary line.

    Bounds are shown when the model has weights (no parameter on the meta device).
    """
    with_bounds = not any(p.is_meta for p in model.parameters())
    sites = [s.with_rope_bound(rope_bound) if s.supported else s
             for s in map(runnable, find_attention(model, **inputs))]
    if not sites:
        return "no attention found"
    rows = site_rows(sites, with_bounds)
    n_ok = sum(s.supported for s in sites)
    summary = f"{len(sites)} attention sites, {n_ok} supported"
    n_measured = sum(s.bound_by == "measured" for s in sites)
    if n_measured:
        summary += (f" ({n_measured} bounded by their q and k measured at every call: the "
                    "weights cannot bound them)")
    summary += (f", {sum(s.certified for s in sites)} with a certified bound" if with_bounds
                else "; no weights (meta device): bounds need a saved model directory")
    if not with_bounds and n_ok < len(sites):
        summary += ("\n(on the meta device a table known only by its values, such as an "
                    "interleaved rotary cos/sin table, cannot be recognized: a site refused "
                    "for it may be supported with weights)")
    return tabulate(rows, headers="keys", missingval="") + "\n\n" + summary


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geoscale inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("model", nargs="?", help="a saved model directory, a config.json or "
                                                "package.module:function")
    which.add_argument("--model-type", help="a transformers model type (llama, qwen2, gpt2 "
                                            "…): its default config shrunk, random weights")
    parser.add_argument("--attn-impl", choices=("sdpa", "eager"),
                        help="attention implementation of a Hugging Face model (default: "
                             "the config's, else transformers')")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--rope-bound", choices=ROPE_BOUNDS, default="norm_product")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.model_type is not None:
            loaded = load_model_type(args.model_type, batch=args.batch, seq_len=args.seq_len,
                                     attn_implementation=args.attn_impl)
        else:
            loaded = load_model(args.model, batch=args.batch, seq_len=args.seq_len,
                                attn_implementation=args.attn_impl)
    except (ValueError, OSError) as exc:
        print(f"geoscale inspect: {exc}", file=sys.stderr)
        return 2
    print(loaded.source)
    if not any(p.is_meta for p in loaded.model.parameters()):
        print(sites_report(loaded.model, loaded.inputs, args.rope_bound))
        return 0
    try:
        print(sites_report(loaded.model, loaded.inputs, args.rope_bound))
    except Exception as exc:  # a forward that only runs on real values: say so, not a trace
        logging.getLogger("geoscale_fx").debug("tracing on the meta device", exc_info=True)
        print(f"geoscale inspect: {type(loaded.model).__name__} does not trace on the meta "
              f"device ({type(exc).__name__}: {str(exc).splitlines()[0]}); inspect a saved "
              "directory with its weights, or --model-type for random ones", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
