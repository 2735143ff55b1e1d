"""PNG plots of the benchmark (matplotlib, Agg): spike response, spectral norms, sweeps."""
from __future__ import annotations

from pathlib import Path

from bench.quality import Spread

__all__ = ["spike_plot", "norms_plot", "sweep_plot", "decode_plot", "rl_plot"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spike_plot(series: dict, at: int, path: Path) -> str:
    """(a) max scaled logit and (b) scale per step, one line per method; the FP8 range."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for method, s in series.items():
        ax1.plot(s["max_scaled"], marker="o", ms=3, label=method)
        ax2.plot(s["scale"], marker="o", ms=3, label=method)
    ax1.axhline(448, color="red", ls="--", lw=1, label="E4M3 max (448)")
    for ax in (ax1, ax2):
        ax.axvline(at, color="gray", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("step")
    ax1.set_ylabel("max |S| / scale")
    ax2.set_ylabel("scale (divisor)")
    ax1.set_title("(a) maximum scaled logit")
    ax2.set_title("(b) scale factor")
    ax1.legend(fontsize=8)
    fig.suptitle(f"4x attention-weight spike at step {at}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name


def norms_plot(per_model: dict, path: Path) -> str:
    """Per-layer ‖W^Q W^Kᵀ‖₂ (paper) and max per-head norm, one panel per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(per_model), figsize=(4.5 * len(per_model), 3.6),
                             squeeze=False)
    for ax, (name, rows) in zip(axes[0], per_model.items()):
        layers = [r["layer"] for r in rows]
        ax.plot(layers, [r["per-layer sigma"] for r in rows], marker="o", label="per layer")
        ax.plot(layers, [r["max head sigma"] for r in rows], marker="s", label="max per head")
        ax.set_title(name)
        ax.set_xlabel("layer")
        ax.set_ylabel("spectral norm")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name


def sweep_plot(rows: list[dict], path: Path) -> str:
    """Forward time and peak extra memory against sequence length, per method."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == method]
        ax1.plot([r["seq len"] for r in pts], [r["forward ms"] for r in pts], marker="o",
                 label=method)
        ax2.plot([r["seq len"] for r in pts], [r["peak MB"] for r in pts], marker="o",
                 label=method)
    for ax, label in ((ax1, "forward ms"), (ax2, "peak extra memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name


def _method_bars(ax, rows: list[dict], group: str, value: str, prefix: str = "") -> None:
    """Bars of ``row[value]``, one per method, side by side within each (model, ``group``);
    a ``bench.quality.Spread`` is drawn as its median with a min–max whisker."""
    groups = list(dict.fromkeys((r["model"], r[group]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        cells = [next(r[value] for r in rows if (r["model"], r[group]) == g
                      and r["method"] == method) for g in groups]
        values = [getattr(c, "median", c) for c in cells]
        spreads = isinstance(cells[0], Spread)
        whiskers = [[v - c.low for v, c in zip(values, cells)],
                    [c.high - v for v, c in zip(values, cells)]] if spreads else None
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=method,
               yerr=whiskers, capsize=2 if spreads else 0)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{prefix}{g}" for m, g in groups], fontsize=8)


def decode_plot(rows: list[dict], series: dict, path: Path) -> str:
    """(a) decoding tokens/s as a ratio to plain Inductor, per model and batch; (b) geometry's
    largest scaled logit per decode step (audit pass) against the FP8 range."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _method_bars(ax1, rows, "batch", "ratio", "batch ")
    ax1.axhline(1.0, color="gray", ls=":", lw=1)
    ax1.set_ylabel("tokens/s / plain Inductor's")
    ax1.set_title("(a) decoding throughput")
    ax1.legend(fontsize=8)
    for name, values in series.items():
        ax2.plot(range(1, len(values) + 1), values, marker="o", ms=2, label=name)
    ax2.axhline(448, color="red", ls="--", lw=1, label="E4M3 max (448)")
    ax2.set_yscale("log")
    ax2.set_xlabel("decode step")
    ax2.set_ylabel("max |S| / scale")
    ax2.set_title("(b) geometry: largest scaled logit")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name


def kv_cache_plot(rows: list[dict], path: Path) -> str:
    """(a) logit error of each scale source against the unquantized model, before and after
    fine-tuning (median, min–max over prompts); (b) how much of the FP8 range the stored
    entries use (saturated above 1)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _method_bars(ax1, rows, "phase", "logit rel. L2")
    _method_bars(ax2, rows, "phase", "max |x|/scale / R_max")
    for ax in (ax1, ax2):
        ax.set_yscale("log")
    ax1.set_ylabel("||logits - unquantized|| / ||unquantized||")
    ax1.set_title("(a) error of the FP8 KV cache")
    ax1.legend(fontsize=8)
    ax2.axhline(1.0, color="red", ls="--", lw=1, label="R_max (saturation)")
    ax2.set_ylabel("max |x / scale| / R_max")
    ax2.set_title("(b) FP8 range used by the cached entries")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name


def rl_plot(per_model: dict, sources, path: Path) -> str:
    """Per model (a row): (a) the largest |log p(trainer) − log p(rollout)| of any token per
    sync (sources that never differ from the trainer are left out: a log scale) and (b)
    saturated cache entries per sync, one line per source of k/v scales; the key and value
    projections' drift dotted."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(per_model), 2, figsize=(12, 3.8 * len(per_model)),
                             squeeze=False)
    for (ax1, ax2), (name, per_sync) in zip(axes, per_model.items()):
        syncs = [s["sync"] for s in per_sync]
        for source in sources:
            if any(s[source]["max"] > 0 for s in per_sync):
                ax1.plot(syncs, [s[source]["max"] for s in per_sync], marker="o", ms=3,
                         label=source)
            ax2.plot(syncs, [s[source]["saturated"] for s in per_sync], marker="o", ms=3,
                     label=source)
        ax1.set_yscale("log")
        ax1.set_ylabel("max |Δ log p| of a token")
        ax1.set_title(f"(a) {name}: worst token per sync")
        ax2.set_yscale("symlog", linthresh=1)
        ax2.set_ylabel("saturated cache entries")
        ax2.set_title(f"(b) {name}: KV-cache saturation")
        drift = ax2.twinx()
        for role, dots in (("key", ":"), ("value", "-.")):
            drift.plot(syncs, [s[f"{role} drift"] for s in per_sync], color="gray", ls=dots)
        drift.set_ylabel("||W - W0|| / ||W0||: keys dotted, values dash-dot")
        for ax in (ax1, ax2):
            ax.set_xlabel("sync (after GRPO step)")
        ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name
