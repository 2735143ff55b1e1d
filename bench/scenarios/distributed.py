"""Scenario 13: training step time on 2 CPU processes (gloo), tensor parallel and FSDP2.

One process group of 2 ranks runs every distributed configuration back to back; the
single-process runs happen in this process right before, on the same machine, so every
ratio compares numbers measured minutes apart. Each rank times its own steps (median).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch

from bench.runner import Context, ScenarioResult

__all__ = ["scale_out", "measure"]

#: name -> geoscale options (None: the same per-block compile without geoscale)
_METHODS = {"plain": None, "geometry/head": {}, "geometry/layer": {"granularity": "layer"}}
_CONFIGS = {"one process": ("plain", "geometry/head", "geometry/layer"),
            "TP 2": ("plain", "geometry/head", "geometry/layer"),
            "FSDP2 2": ("plain", "geometry/head")}
VOCAB, LENGTH, BATCH = 256, 128, 8


def _model():
    from models_zoo.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4, n_embd=128,
                         qkv="separate"))


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.c_q": ColwiseParallel(), "attn.c_k": ColwiseParallel(),
            "attn.c_v": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}


def _build(config: str, method: str, compiler: str, mesh):
    """The model for one configuration, in torchtitan's order: TP, per-block compile, FSDP2."""
    import geoscale_fx

    model = _model()
    blocks = list(model.transformer.h)
    if config == "TP 2":
        from torch.distributed.tensor.parallel import parallelize_module

        for block in blocks:
            parallelize_module(block, mesh, _tp_plan())
    options = _METHODS[method]
    if options is None:
        for block in blocks:
            block.compile(backend=compiler)
    else:
        geoscale_fx.compile_blocks(model, blocks, compiler=compiler, **options)
    if config == "FSDP2 2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _step_ms(config: str, method: str, compiler: str, steps: int, mesh=None,
             rank: int = 0, world: int = 1) -> dict:
    """Compile (the first two steps) and the median of ``steps`` timed training steps."""
    torch._dynamo.reset()
    model = _build(config, method, compiler, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    if config == "FSDP2 2":       # data parallel: this rank's half of the batch
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()

    start = time.perf_counter()
    step()
    step()
    compile_s = time.perf_counter() - start
    samples = []
    for _ in range(steps):
        if mesh is not None:
            torch.distributed.barrier()
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return {"compile s": compile_s, "step ms": 1e3 * statistics.median(samples)}


def _worker(rank: int, world: int, port: int, configs: dict, compiler: str, steps: int,
            out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = [{"config": config, "method": method, "rank": rank,
                 **_step_ms(config, method, compiler, steps, mesh, rank, world)}
                for config, methods in configs.items() if config != "one process"
                for method in methods]
        Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scale_out(ctx: Context) -> ScenarioResult:
    """13. Per-rank training step time, TP and FSDP2 on 2 ranks, against one process."""
    result = ScenarioResult(
        "distributed", "13. Scale-out: training step on 2 CPU processes (gloo), TP and FSDP2 "
        "against one process (nanoGPT 2x128, separate q/k/v, batch 8 x 128)",
        notes="Per-block compile, torchtitan's order (TP, compile, FSDP2). 'vs plain': against "
        "the same configuration without geoscale; 'vs one process': against the same method "
        "in one process. Every process uses 1 thread. TP 2 computes the whole batch on half "
        "the heads per rank; FSDP2 2 half the batch per rank. geometry/head adds no "
        "collective; geometry/layer one all-reduce(MAX) of one float per site and step under "
        "TP. On 2 shared CPU cores gloo's collectives dominate: the ratios say what geoscale "
        "adds, not what scale-out gains.")
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        result.error = "torch.distributed with gloo is not available"
        return result
    result.rows = measure(ctx, _CONFIGS)
    result.data = {"rows": result.rows}
    return result


def measure(ctx: Context, configs: dict[str, tuple[str, ...]]) -> list[dict]:
    """Rows of per-rank step times for ``configs`` (config -> methods), with ratios."""
    import torch.multiprocessing as mp

    steps = ctx.steps(10, 30)
    compiler = ctx.timing_compiler
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # like each rank: OpenMP threads on a loaded machine spin
    try:
        single = {m: _step_ms("one process", m, compiler, steps) for m in configs["one process"]}
    finally:
        torch.set_num_threads(threads)
    out = ctx.out_dir / "distributed"
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(2, _free_port(), configs, compiler, steps, str(out)), nprocs=2)
    rows = [{"config": "one process", "method": m, "rank": 0, **v} for m, v in single.items()]
    for rank in range(2):
        rows += json.loads((out / f"rank{rank}.json").read_text())
    for row in rows:
        plain = next(r for r in rows if r["config"] == row["config"]
                     and r["rank"] == row["rank"] and r["method"] == "plain")
        row["vs plain"] = row["step ms"] / plain["step ms"]
        row["vs one process"] = row["step ms"] / single[row["method"]]["step ms"]
    return rows
