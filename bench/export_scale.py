"""Peak memory and time of ``geoscale export-kv-scales DIR`` on Llama-3-shaped checkpoints.

    python -m bench.export_scale                          # Llama-3.1-8B shape, 32 layers
    python -m bench.export_scale --shape llama3-70b --layers 4
    python -m bench.export_scale --dir /scratch/ckpts     # keep and reuse the checkpoints

A bf16 checkpoint of the shape is written shard by shard with random tensors (safetensors,
never a model in memory; ``config.json`` and ``model.safetensors.index.json`` as
``save_pretrained`` writes them), then each export runs in a fresh subprocess whose peak
resident set (its ``VmHWM`` at exit; file pages it maps count) and wall/CPU time are
reported.
The checkpoint's pages are dropped from the page cache before each run
(``posix_fadvise(DONTNEED)``), so reads come from the disk. Each export runs ``--repeat``
times (default 3): the peak varies between runs of the same command, so the largest (and the
smallest) is reported, with the median times.

Rows: the streamed export (``geoscale export-kv-scales DIR --out OUT``, traced weightless) at
``--layers`` and at ``--compare-layers`` (default 2); the in-memory export
(``from_pretrained`` + ``export_kv_scales(model, ...)``, the route the CLI took before) at
``--compare-layers``, with whether the two wrote bit-identical scales and config. Below the
shape's full depth, the streamed peak and time are extrapolated linearly in the layer count
from the two streamed runs, and the trace alone is measured at full depth (no weights).
Not a unit test: it writes ``~2 GB`` per 8B layer pair and takes minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate

ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: Llama-3.1 shapes (the published config.json values)
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, num_hidden_layers=32),
    "llama3-70b": dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256, num_hidden_layers=80),
}
SHARD_BYTES = 2 << 30
GB = 1e9


def llama_config(shape: str, layers: int):
    from transformers import LlamaConfig

    kwargs = {**SHAPES[shape], "num_hidden_layers": layers}
    return LlamaConfig(**kwargs, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_parameters=dict(ROPE), tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=128001, dtype="bfloat16")


def checkpoint_bytes(config) -> int:
    return sum(t.numel() * 2 for t in _meta_state(config).values())


def _meta_state(config) -> dict[str, torch.Tensor]:
    """Name -> meta tensor of what ``save_pretrained`` writes (tied duplicates dropped)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def write_checkpoint(config, directory: Path, seed: int = 0) -> int:
    """Random bf16 shards of ≤ SHARD_BYTES, the index and config.json; returns bytes."""
    from safetensors.torch import save_file

    state = _meta_state(config)
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random(state[n].shape, g) for n in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        del tensors
    total = sum(t.numel() * 2 for t in state.values())
    index = {"metadata": {"total_parameters": total // 2, "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.save_pretrained(directory)
    return total


def _random(shape, g: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.bfloat16)
    if t.dim() == 1:                                   # norm gains
        return t.uniform_(0.5, 1.5, generator=g)
    return t.uniform_(-0.03, 0.03, generator=g)


def drop_page_cache(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class Run:
    peak_bytes: int                  # the largest over the repeats
    wall_s: float                    # medians over the repeats
    cpu_s: float
    peak_min_bytes: int = 0


def repeated(run, times: int) -> Run:
    """``run()`` ``times`` times: the peak varies from run to run (glibc's adaptive mmap
    threshold decides whether freed blocks leave the resident set), so the largest is kept."""
    runs = [run() for _ in range(times)]
    return Run(max(r.peak_bytes for r in runs), statistics.median(r.wall_s for r in runs),
               statistics.median(r.cpu_s for r in runs), min(r.peak_bytes for r in runs))


#: Runs a module (``-m name args``) or code (``-c code args``) and, at exit, writes the
#: process's own ``VmHWM`` (peak resident set of its image). The child's ``ru_maxrss`` would
#: not do: Linux carries the parent's high-water mark across fork and exec into it.
_MEASURED = """
import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        kb = next(line for line in f if line.startswith("VmHWM:")).split()[1]
    with open(os.environ["EXPORT_SCALE_PEAK_FILE"], "w") as f:
        f.write(kb)
atexit.register(_peak)
mode, target, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
if mode == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(compile(target, "<bench>", "exec"), {"__name__": "__main__"})
"""


def measure(args: list[str], log_path: Path) -> Run:
    """Run ``python -m module …`` / ``python -c code …`` in a fresh process: its own peak
    resident set (``VmHWM`` at exit), wall time, and CPU time (``wait4``)."""
    peak_file = log_path.with_suffix(".peak")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EXPORT_SCALE_PEAK_FILE": str(peak_file)}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _MEASURED, *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    text = log_path.read_text()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{args[:3]} exited {os.waitstatus_to_exitcode(status)}:\n"
                           f"{text[-3000:]}")
    peak = int(peak_file.read_text()) * 1024
    return Run(peak, wall, usage.ru_utime + usage.ru_stime, peak)


def streamed(ckpt: Path, out: Path, work: Path) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    drop_page_cache(ckpt)
    return measure(["-m", "geoscale_fx", "export-kv-scales", str(ckpt), "--out", str(out)],
                   work / f"{out.name}.log")


_IN_MEMORY = """
import sys, torch
from transformers import AutoModelForCausalLM
from geoscale_fx.export.kv_scales import export_kv_scales
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.randint(0, model.config.vocab_size, (1, 8),
                    generator=torch.Generator().manual_seed(0))
export_kv_scales(model, sys.argv[2], input_ids=ids)
"""

_TRACE_ONLY = """
import sys
from geoscale_fx.export.safetensors_reader import CheckpointReader
from geoscale_fx.export.streamed_scales import meta_model, traced_graphs
from geoscale_fx.analysis.analyze import analyze_graph
model = meta_model(sys.argv[1], CheckpointReader(sys.argv[1]))
graphs = traced_graphs(model)
sites = [s for i, g in enumerate(graphs)
         for s in analyze_graph(g.gm, g.example_inputs, graph_index=i)]
assert len(sites) == model.config.num_hidden_layers and all(s.supported for s in sites)
"""


def in_memory(ckpt: Path, out: Path, work: Path) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    drop_page_cache(ckpt)
    return measure(["-c", _IN_MEMORY, str(ckpt), str(out)], work / f"{out.name}.log")


def trace_only(config, work: Path) -> Run:
    """The weightless trace and analysis at full depth: config.json and an empty index only."""
    directory = work / "config-only"
    directory.mkdir(exist_ok=True)
    config.save_pretrained(directory)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {}}))
    return measure(["-c", _TRACE_ONLY, str(directory)], work / "trace.log")


def identical(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    ta, tb = (load_file(str(d / "kv_scales.safetensors")) for d in (a, b))
    same = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    config = [json.loads((d / "quantization_config.json").read_text()) for d in (a, b)]
    return same and config[0] == config[1]


def _row(route, layers, ckpt_bytes, run: Run, identical_cell=""):
    low = f"{run.peak_min_bytes / GB:.2f}" if run.peak_min_bytes else ""
    return [route, layers, f"{ckpt_bytes / GB:.1f}", f"{run.peak_bytes / GB:.2f}", low,
            f"{run.wall_s:.1f}", f"{run.cpu_s:.1f}", identical_cell]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.export_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, help="layers of the generated checkpoint "
                        "(default: the shape's full depth)")
    parser.add_argument("--compare-layers", type=int, default=2,
                        help="layers of the checkpoint the in-memory export runs on (default 2)")
    parser.add_argument("--dir", type=Path, help="keep the checkpoints in DIR/<shape>-<n>l "
                        "and reuse them on the next run (default: a temporary directory, "
                        "deleted)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each export: the "
                        "largest peak and the median times are reported (default 3)")
    args = parser.parse_args(argv)
    full = SHAPES[args.shape]["num_hidden_layers"]
    layers = args.layers or full
    counts = sorted({layers, args.compare_layers})
    configs = {n: llama_config(args.shape, n) for n in counts}
    sizes = {n: checkpoint_bytes(c) for n, c in configs.items()}
    work = Path(tempfile.mkdtemp(prefix="export_scale_"))
    store = args.dir or work
    ckpts = {n: store / f"{args.shape}-{n}l" for n in counts}
    todo = [n for n in counts if not (ckpts[n] / "model.safetensors.index.json").exists()]
    store.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(store).free
    if sum(sizes[n] for n in todo) * 1.05 > free:
        shutil.rmtree(work)
        raise SystemExit(f"{sum(sizes[n] for n in todo) / GB:.1f} GB of checkpoints do not "
                         f"fit in {free / GB:.1f} GB free at {store}; pass fewer --layers")
    rows, runs = [], {}
    try:
        for n in todo:
            start = time.perf_counter()
            write_checkpoint(configs[n], ckpts[n])
            print(f"wrote {sizes[n] / GB:.1f} GB ({n} layers) in "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
        for n in counts:
            runs[n] = repeated(lambda: streamed(ckpts[n], work / f"streamed-{n}", work),
                               args.repeat)
        n = args.compare_layers
        ref = repeated(lambda: in_memory(ckpts[n], work / f"in-memory-{n}", work), args.repeat)
        same = identical(work / f"streamed-{n}", work / f"in-memory-{n}")
        for m in counts:
            rows.append(_row("streamed (weightless trace)", m, sizes[m], runs[m],
                             ("yes" if same else "NO") if m == n else ""))
        rows.append(_row("in memory (from_pretrained)", n, sizes[n], ref,
                         "yes" if same else "NO"))
        if layers < full and len(counts) == 2:
            rows += _extrapolated(counts, runs, full, checkpoint_bytes(llama_config(
                args.shape, full)))
            rows.append(_row("trace + analysis only", full, 0, trace_only(
                llama_config(args.shape, full), work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.shape}, bf16, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; page cache dropped before each run; {args.repeat} runs "
          "each: largest and smallest peak, median times")
    print(tabulate(rows, headers=["export", "layers", "checkpoint GB", "peak RSS GB",
                                  "smallest peak", "wall s", "CPU s", "bit-identical"]))
    return 0 if all(r[-1] != "NO" for r in rows) else 1


def _extrapolated(counts, runs, full, full_bytes) -> list[list]:
    """Linear in the layer count through the two streamed runs (an estimate, labelled so)."""
    a, b = counts
    def at(field):
        va, vb = getattr(runs[a], field), getattr(runs[b], field)
        return va + (vb - va) / (b - a) * (full - a)
    run = Run(int(at("peak_bytes")), at("wall_s"), at("cpu_s"), int(at("peak_min_bytes")))
    return [_row(f"streamed, extrapolated from {a} and {b} layers", full, full_bytes, run)]


if __name__ == "__main__":
    sys.exit(main())
