"""Pretrain small byte-level GPT-2 and Llama models on the stdlib sources, cached on disk.

    python -m models_zoo.pretrain [--family gpt2|llama|all] [--steps N] [--force]

A :class:`Recipe` (family, shape, optimisation, data budget, seed) fully determines a run.
Its checkpoint lives at ``<cache>/pretrained/<family>-<key>/`` where ``key`` is the first 12
hex digits of sha256(recipe JSON + "\\n" + corpus sha256) — the corpus is part of the key
because the stdlib differs between Python versions — and ``<cache>`` is ``$GEOSCALE_CACHE``,
else ``$XDG_CACHE_HOME/geoscale_fx``, else ``~/.cache/geoscale_fx``. The directory holds the
``save_pretrained`` output (``config.json``, ``model.safetensors``), ``recipe.json`` and
``metrics.json`` (train / validation loss, bits per byte, steps, seconds). It is written
under a temporary name and renamed, so a crash never leaves a half checkpoint behind. The
quick profile's checkpoints are also kept in the repository (``models_zoo/checkpoints/``,
``SHIPPED``), read when their key matches: a fresh machine's first ``python -m bench`` does
not pretrain.

The default recipes take about two CPU minutes per family on two cores and reach a
validation loss far below a uniform byte model's ln 256 ≈ 5.55 nats: their attention is
trained, not random, which is what the FP8 scaling experiments need.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models_zoo import configs, corpus

__all__ = ["Recipe", "DEFAULT_RECIPES", "cache_root", "checkpoint_dir", "shipped_dir",
           "SHIPPED", "train", "load_pretrained", "main"]

logger = logging.getLogger("geoscale_fx.models_zoo")

FAMILIES = ("gpt2", "llama")


@dataclass(frozen=True)
class Recipe:
    """Everything that determines a pretraining run (and so its cache key)."""

    family: str  # "gpt2" (GPT2LMHeadModel) | "llama" (LlamaForCausalLM)
    config: dict = field(hash=False)  # shape kwargs for configs.hf_config
    steps: int = 600
    lr: float = 3e-3  # peak; linear warmup, then cosine down to lr · min_lr_ratio
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    batch_size: int = 32
    seq_len: int = 128
    seed: int = 0
    data_budget_bytes: int = 4_000_000
    val_every: int = 10  # every val_every-th stdlib file is held out
    val_windows: int = 64

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}; allowed values: {FAMILIES}")
        for name in ("steps", "batch_size", "seq_len", "data_budget_bytes", "val_windows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps]")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr={self.lr} must be > 0, min_lr_ratio in [0, 1]")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def lr_at(self, step: int) -> float:
        """Linear warmup over ``warmup_steps``, then cosine decay to ``lr · min_lr_ratio``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


DEFAULT_RECIPES = {
    "gpt2": Recipe("gpt2", configs.HF_SMALL["hf-gpt2"][1]),
    "llama": Recipe("llama", configs.HF_SMALL["hf-llama"][1]),
}


def cache_root() -> Path:
    """``$GEOSCALE_CACHE``, else ``$XDG_CACHE_HOME/geoscale_fx``, else ``~/.cache/geoscale_fx``."""
    if os.environ.get("GEOSCALE_CACHE"):
        return Path(os.environ["GEOSCALE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "geoscale_fx"


def checkpoint_dir(recipe: Recipe, corpus_sha256: str) -> Path:
    """``<cache>/pretrained/<family>-<sha256(recipe JSON, corpus)[:12]>``."""
    return cache_root() / "pretrained" / _checkpoint_name(recipe, corpus_sha256)


def _checkpoint_name(recipe: Recipe, corpus_sha256: str) -> str:
    key = hashlib.sha256(f"{recipe.to_json()}\n{corpus_sha256}".encode()).hexdigest()[:12]
    return f"{recipe.family}-{key}"


#: checkpoints kept in the repository (the quick profile's, a fresh machine's first bench
#: run needs no pretraining), under the same names as in the cache: used when their key
#: (recipe and corpus: the stdlib of this Python) matches, trained otherwise
SHIPPED = Path(__file__).resolve().parent / "checkpoints"


def shipped_dir(recipe: Recipe, corpus_sha256: str) -> Path | None:
    """The repository's checkpoint for this recipe and corpus, if it has one."""
    path = SHIPPED / _checkpoint_name(recipe, corpus_sha256)
    return path if (path / "metrics.json").is_file() else None


def _model_class(family: str):
    import transformers

    return {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[family]


@torch.no_grad()
def _mean_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` over ``windows (N, T)``."""
    model.eval()
    losses = [model(input_ids=chunk, labels=chunk).loss for chunk in windows.split(batch_size)]
    return torch.stack(losses).mean().item()


def _optimize(model, recipe: Recipe, train_bytes: torch.Tensor) -> list[float]:
    """Run ``recipe.steps`` AdamW steps on random windows; the per-step training losses."""
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95),
                                  weight_decay=recipe.weight_decay)
    batches = torch.Generator().manual_seed(recipe.seed)
    losses = []
    model.train()
    progress = tqdm(range(recipe.steps), desc=f"pretrain {recipe.family}", file=sys.stderr,
                    mininterval=1.0)
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step)
        input_ids = corpus.random_windows(train_bytes, recipe.batch_size, recipe.seq_len, batches)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0:
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def train(recipe: Recipe, out_dir: Path, data: corpus.ByteCorpus | None = None) -> dict:
    """Train ``recipe`` from scratch and save it to ``out_dir``; returns the metrics."""
    data = data or corpus.load_stdlib_corpus(recipe.data_budget_bytes, recipe.val_every)
    config = configs.hf_config(recipe.family, recipe.config, "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = _model_class(recipe.family)(config)
    val_windows = corpus.strided_windows(data.val, recipe.val_windows, recipe.seq_len)
    val_loss_init = _mean_loss(model, val_windows, recipe.batch_size)
    start = time.perf_counter()
    losses = _optimize(model, recipe, data.train)
    seconds = time.perf_counter() - start
    val_loss = _mean_loss(model, val_windows, recipe.batch_size)
    metrics = {
        "family": recipe.family, "steps": recipe.steps, "seconds": round(seconds, 2),
        "train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "val_loss": val_loss, "val_bits_per_byte": val_loss / math.log(2),
        "val_loss_init": val_loss_init, "n_params": sum(p.numel() for p in model.parameters()),
        "train_bytes": data.train.numel(), "val_bytes": data.val.numel(),
        "corpus_sha256": data.sha256, "torch": torch.__version__,
    }
    _save_atomically(model, recipe, metrics, out_dir)
    return metrics


def _save_atomically(model, recipe: Recipe, metrics: dict, out_dir: Path) -> None:
    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir)
    (tmp_dir / "recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=2))
    (tmp_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    # another process (a parallel test worker) may be reading or writing the same entry:
    # move an old one aside atomically instead of deleting it under its readers
    old_dir = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(old_dir, ignore_errors=True)
    try:
        os.replace(out_dir, old_dir)
    except FileNotFoundError:
        pass
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:            # another process saved the same recipe in between: keep it
        shutil.rmtree(tmp_dir, ignore_errors=True)
    shutil.rmtree(old_dir, ignore_errors=True)


def load_pretrained(family: str, recipe: Recipe | None = None, *,
                    attn_implementation: str = "sdpa", force: bool = False):
    """``(model, metrics)`` for ``family``'s recipe: from the cache, else trained (and cached).

    ``model`` is a GPT2LMHeadModel / LlamaForCausalLM in eval mode on the CPU; ``metrics`` is
    the content of ``metrics.json``. ``force=True`` retrains even when cached.
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}; allowed values: {FAMILIES}")
    recipe = recipe or DEFAULT_RECIPES[family]
    if recipe.family != family:
        raise ValueError(f"recipe.family={recipe.family!r} does not match family={family!r}")
    data = corpus.load_stdlib_corpus(recipe.data_budget_bytes, recipe.val_every)
    out_dir = checkpoint_dir(recipe, data.sha256)
    shipped = shipped_dir(recipe, data.sha256)
    if not force and shipped is not None and not (out_dir / "metrics.json").is_file():
        out_dir = shipped
    if force or not (out_dir / "metrics.json").is_file():
        logger.info("no pretrained %s checkpoint at %s: training it (%d steps, a few CPU "
                    "minutes)", family, out_dir, recipe.steps)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        train(recipe, out_dir, data)
    model = _model_class(family).from_pretrained(out_dir, attn_implementation=attn_implementation)
    metrics = json.loads((out_dir / "metrics.json").read_text())
    return model.eval(), metrics


def main(argv: list[str] | None = None) -> int:
    from tabulate import tabulate

    parser = argparse.ArgumentParser(prog="python -m models_zoo.pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=(*FAMILIES, "all"), default="all")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--force", action="store_true", help="retrain even when cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for family in FAMILIES if args.family == "all" else (args.family,):
        recipe = DEFAULT_RECIPES[family]
        if args.steps is not None:
            recipe = dataclasses.replace(recipe, steps=args.steps,
                                         warmup_steps=min(recipe.warmup_steps, args.steps))
        _, metrics = load_pretrained(family, recipe, force=args.force)
        data_sha = metrics["corpus_sha256"]
        rows.append([family, metrics["steps"], metrics["train_loss"], metrics["val_loss"],
                     metrics["val_bits_per_byte"], metrics["seconds"],
                     str(checkpoint_dir(recipe, data_sha))])
    print(tabulate(rows, headers=["family", "steps", "train loss", "val loss (nats)",
                                  "val bits/byte", "train s", "checkpoint"], floatfmt=".3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
