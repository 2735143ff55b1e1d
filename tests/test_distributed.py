"""Scale-out on CPU processes with gloo: tensor parallel, FSDP2, both (2-D), DCP round trips.

The 2-rank checks run one after the other in one process group (``two_ranks``: one spawn
for the module, not one per test), each reported by its own test: a failing assertion in a
worker fails that test with the worker's traceback, and the checks the failure kept from
running run alone, each in its own process group. The 2-D mesh spawns its own 4 processes.
The references are independent: the same model in one process (no DTensor, no FSDP), and
float64 spectral norms of explicit matrices (torch.linalg) for the bounds.
"""
from __future__ import annotations

import copy
import functools
import math
import multiprocessing
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import geoscale_fx  # noqa: E402
from models_zoo.nanogpt import GPT, GPTConfig  # noqa: E402
from tests.dynamo_bookkeeping import skip_log_only_bookkeeping  # noqa: E402

ETA, R_MAX = 0.8, 448.0
VOCAB, D, N_HEAD, D_H = 64, 32, 4, 8


# --------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, name: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1",
                      TRANSFORMERS_VERBOSITY="error")
    torch.set_num_threads(1)
    skip_log_only_bookkeeping()      # as in the test workers (tests/conftest.py)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        globals()[name](rank, world, *args)
    finally:
        dist.destroy_process_group()


def _spawn(worker, world: int = 2, *args) -> None:
    """``world`` processes running ``worker``, forked from a server that imported this module
    (torch, geoscale_fx, transformers) once: a freshly spawned process spent ~5 s of CPU on
    those imports, and the module starts six."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "transformers"])
    mp.start_processes(_entry, args=(world, _free_port(), worker.__name__, args), nprocs=world,
                       start_method="forkserver")


def _checks(rank: int, world: int, out: str, checks: tuple) -> None:
    """Run ``checks`` (pairs of worker name and arguments) in order, each as in a fresh
    process (Dynamo reset, counters cleared, patched compilers and the environment put
    back); ``out`` gets ``NAME.RANK.passed`` or ``NAME.RANK.failed`` (the traceback). A
    failure ends the process group: the checks after it have no file."""
    import geoscale_fx.compile.dynamo_backend as backend_module

    compiler, environ = backend_module.aot_eager, dict(os.environ)
    for name, args in checks:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        try:
            globals()[name](rank, world, *args)
        except BaseException:
            Path(out, f"{name}.{rank}.failed").write_text(traceback.format_exc())
            raise
        finally:
            backend_module.aot_eager = compiler
            os.environ.clear()
            os.environ.update(environ)
        Path(out, f"{name}.{rank}.passed").touch()
        dist.barrier()      # no rank starts the next check's collectives alone


def _spawn_checks(checks: tuple, out: Path, world: int = 2) -> dict[str, str | None]:
    """Each check's outcome in one process group: "passed", the failing rank's traceback,
    or None where a failure elsewhere kept it from running."""
    try:
        _spawn(_checks, world, str(out), checks)
    except Exception:   # noqa: BLE001 - the files say which check failed, and how
        pass
    outcome: dict[str, str | None] = {}
    for name, _ in checks:
        failed = sorted(out.glob(f"{name}.*.failed"))
        if failed:
            outcome[name] = "\n".join(f"rank {f.name.split('.')[1]}:\n{f.read_text()}"
                                      for f in failed)
        elif all((out / f"{name}.{rank}.passed").exists() for rank in range(world)):
            outcome[name] = "passed"
        else:
            outcome[name] = None
    return outcome


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The module's 2-rank checks, run once in one process group; ``check(worker, *args)``
    fails with the worker's traceback, or runs a check that never ran alone."""
    root = tmp_path_factory.mktemp("two_ranks")
    checks = [("_tp_matches_single_process", ()), ("_tp_trains", ()),
              ("_tp_per_layer_placements_collectives", ()), ("_fsdp2", ()),
              ("_dcp", (str(root / "dcp"),))]
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        _llama(2).save_pretrained(root / "llama")
        checks += [("_tp_hf_llama_sharded_kv", ()), ("_hf_tp_plan_auto", (str(root / "llama"),))]
        if not _compile_reads_exporting():   # else it fails in Dynamo, without geoscale too
            checks += [("_tp_hf_llama_replicated_kv", ())]
    (root / "dcp").mkdir()
    (root / "outcomes").mkdir()
    outcome = _spawn_checks(tuple(checks), root / "outcomes")
    arguments = dict(checks)

    def check(worker) -> Path:
        result = outcome.get(worker.__name__)
        if result is None:     # kept from running by an earlier failure: run it alone
            _spawn(worker, 2, *arguments[worker.__name__])
        elif result != "passed":
            pytest.fail(f"{worker.__name__} failed\n{result}", pytrace=False)
        return root

    return check


def _gathered(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


# --------------------------------------------------------------------------------------
# Models and plans
# --------------------------------------------------------------------------------------

def _gpt(seed: int = 0, bias: bool = True, n_layer: int = 2) -> GPT:
    """nanoGPT with separate q/k/v (4 heads of 8) and non-trivial LayerNorm gains."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_head=N_HEAD,
                          n_embd=D, qkv="separate", bias=bias))
    with torch.no_grad():
        for block in model.transformer.h:
            block.ln_1.weight.uniform_(0.5, 1.5)
    return model


def _tp_plan(rowwise_qkv: bool = False) -> dict:
    """Megatron's plan: q/k/v and c_fc colwise, the output projections rowwise. With
    ``rowwise_qkv`` q/k/v are sharded on d_model instead (each rank holds part of every
    head; outputs all-reduced) and the attention's c_proj stays replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mlp = {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    if rowwise_qkv:
        return {f"attn.c_{n}": RowwiseParallel(input_layouts=Replicate()) for n in "qkv"} | mlp
    return {"attn.c_q": ColwiseParallel(), "attn.c_k": ColwiseParallel(),
            "attn.c_v": ColwiseParallel(), "attn.c_proj": RowwiseParallel()} | mlp


def _parallelize(model: GPT, mesh, plan=None) -> GPT:
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.transformer.h:
        parallelize_module(block, mesh, plan or _tp_plan())
    return model


def _tokens(seed: int, batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _scales(backend) -> dict[str, torch.Tensor]:
    return {key: r.state.scale.clone() for key, r in backend.records.items()}


def _reference_scale(model: GPT, block: int, heads: list[int]) -> float:
    """Independent per-layer or per-head reference for the first forward of ``_gpt()``
    (zero biases): ``s·d·‖A_q A_kᵀ‖₂ / (η·R_max)`` with ``A = diag(g)·W[rows]ᵀ`` over the
    given heads' rows, in float64 with torch.linalg."""
    blk = model.transformer.h[block]
    gain = blk.ln_1.weight.detach().double()
    rows = torch.cat([torch.arange(h * D_H, (h + 1) * D_H) for h in heads])
    a_q = gain[:, None] * blk.attn.c_q.weight.detach().double()[rows].T
    a_k = gain[:, None] * blk.attn.c_k.weight.detach().double()[rows].T
    sigma = torch.linalg.matrix_norm(a_q @ a_k.T, ord=2).item()
    return sigma * D / math.sqrt(D_H) / (ETA * R_MAX)


def _count_collectives(store: list):
    """An aot_eager that records how many functional collectives each forward graph has."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, _inputs):
        store.append(sum(1 for n in gm.graph.nodes
                         if str(n.target).startswith("_c10d_functional.")
                         and "wait" not in str(n.target)))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))


# --------------------------------------------------------------------------------------
# Tensor parallel
# --------------------------------------------------------------------------------------

def _tp_matches_single_process(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = _tokens(1)
    mine = list(range(rank * N_HEAD // world, (rank + 1) * N_HEAD // world))
    # scaling="none": the rewritten graph computes what one process computes
    single, tp = _gpt(bias=True), _parallelize(_gpt(bias=True), mesh)
    backends = [geoscale_fx.compile_blocks(m, m.transformer.h, compiler="aot_eager",
                                           scaling="none") for m in (single, tp)]
    with torch.no_grad():
        diff = (tp(x)[0] - single(x)[0]).abs().max().item()
    assert [len(b.records) for b in backends] == [2, 2] and not backends[1].skipped
    assert diff < 1e-5, diff
    # geometry, per head: each rank's scales are the single-process scales of its heads
    single, tp = _gpt(bias=False), _parallelize(_gpt(bias=False), mesh)
    be1 = geoscale_fx.compile_blocks(single, single.transformer.h, compiler="aot_eager",
                                     estimator="exact")
    be2 = geoscale_fx.compile_blocks(tp, tp.transformer.h, compiler="aot_eager",
                                     estimator="exact")
    with torch.no_grad():
        single(x), tp(x)
    assert sorted(be2.records) == [f"transformer_h_{b}_attn_tp{rank}" for b in range(2)]
    for b in range(2):
        scale = be2.records[f"transformer_h_{b}_attn_tp{rank}"].state.scale
        full = be1.records[f"transformer_h_{b}_attn"].state.scale
        torch.testing.assert_close(scale, full[mine], rtol=1e-6, atol=0)
        ref = torch.tensor([_reference_scale(single, b, [h]) for h in mine], dtype=torch.float64)
        torch.testing.assert_close(scale.double(), ref, rtol=1e-5, atol=0)
    rows = geoscale_fx.report(be2, per_head=True).rows
    assert [r["head"] for r in rows] == mine * 2
    assert rows[0]["tp"] == f"tp {rank}/2: heads {mine[0]}-{mine[-1]} of 4"


def test_tensor_parallel_matches_single_process(two_ranks):
    """Colwise q/k/v, rowwise o, per-block compile: same output (scaling="none"), each rank
    has the single-process per-head scales of its own heads (= the float64 reference)."""
    two_ranks(_tp_matches_single_process)


def _tp_trains(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    mine = list(range(rank * N_HEAD // world, (rank + 1) * N_HEAD // world))
    single, tp = _gpt(bias=True), _parallelize(_gpt(bias=True), mesh)
    be1 = geoscale_fx.compile_blocks(single, single.transformer.h, compiler="aot_eager",
                                     estimator="exact")
    be2 = geoscale_fx.compile_blocks(tp, tp.transformer.h, compiler="aot_eager",
                                     estimator="exact")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (single, tp)]
    for step in range(3):
        losses = []
        for model, opt in zip((single, tp), opts):
            loss = model(_tokens(step), _tokens(step + 10))[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-5, (step, losses)
    for b in range(2):
        torch.testing.assert_close(be2.records[f"transformer_h_{b}_attn_tp{rank}"].state.scale,
                                   be1.records[f"transformer_h_{b}_attn"].state.scale[mine],
                                   rtol=1e-4, atol=0)   # AdamW amplifies reduction-order noise


def test_tensor_parallel_trains_like_one_process(two_ranks):
    """Three AdamW steps (explicit lowering, biases): the same losses and per-head scales."""
    two_ranks(_tp_trains)


def _tp_per_layer_placements_collectives(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import geoscale_fx.compile.dynamo_backend as backend_module   # compiles a graph with its aot_eager

    mesh = init_device_mesh("cpu", (world,))
    x = _tokens(2)
    counts: dict[str, list] = {}
    plain_backend = _count_collectives(counts.setdefault("plain", []))
    plain = _parallelize(_gpt(bias=False), mesh)
    for block in plain.transformer.h:
        block.compile(backend=plain_backend)
    with torch.no_grad():
        plain(x)
    for granularity in ("head", "layer"):
        backend_module.aot_eager = _count_collectives(counts.setdefault(granularity, []))
        model = _parallelize(_gpt(bias=False), mesh)
        # fused: the explicit lowering would also reduce its observed max|S| per layer
        backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager",
                                             estimator="exact", granularity=granularity,
                                             lowering="fused")
        with torch.no_grad():
            model(x)
        if granularity == "layer":   # one scale per layer, the same on every rank
            reference = _gpt(bias=False)
            for b in range(2):
                scale = backend.records[f"transformer_h_{b}_attn_tp{rank}"].state.scale
                assert scale.shape == (1,)
                assert torch.equal(*_gathered(scale)), _gathered(scale)
                # max over ranks of the per-layer bound of the rank's heads (float64 reference)
                ref = max(_reference_scale(reference, b, [0, 1]),
                          _reference_scale(reference, b, [2, 3]))
                assert math.isclose(scale.item(), ref, rel_tol=1e-5), (scale.item(), ref)
    # per head: not one collective more than the TP model itself; per layer: one all-reduce.
    # An inference graph compiles two variants (predictive, weight-reusing): each is counted.
    assert counts["plain"] and counts["head"] and set(counts["head"]) == set(counts["plain"]), \
        counts
    assert counts["layer"] and set(counts["layer"]) == {c + 1 for c in counts["plain"]}, counts
    # q sharded on d_model (rowwise q): no rank holds a whole head's weights -> the weights
    # do not bound it, clearly; the rank's own q and k are measured instead
    before = dict(counters["geoscale"])
    model = _parallelize(_gpt(), mesh, _tp_plan(rowwise_qkv=True))
    backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager")
    with torch.no_grad():
        model(x)
    assert not backend.skipped and backend.records
    reasons = [r.site.unbounded_reason for r in backend.records.values()]
    assert all(r.site.bound_by == "measured" for r in backend.records.values())
    assert reasons and all("Shard(dim=2)" in r and "model dimension d" in r
                           for r in reasons), reasons
    assert counters["geoscale"]["left_as_is"] == before.get("left_as_is", 0)
    assert counters["geoscale"]["measured_sites"] - before.get("measured_sites", 0) == \
        len(reasons)


def test_tensor_parallel_per_layer_max_collectives_and_unsupported_placement(two_ranks):
    """Per layer: one all-reduce MAX (scale identical on both ranks, = max over ranks of the
    float64 per-layer bound of the rank's heads); per head: no collective beyond the TP
    model's own; rowwise q is left as is with a reason naming the placement."""
    two_ranks(_tp_per_layer_placements_collectives)


def _tp_hf_llama(rank, world, n_kv):
    """HF Llama with 4 q heads and ``n_kv`` kv heads, q colwise; k/v colwise where ``n_kv``
    divides among the ranks, else replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    x = _tokens(3, length=7)
    mine = [2 * rank, 2 * rank + 1]
    single = _llama(n_kv)
    tp = copy.deepcopy(single)
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}
    if n_kv % world == 0:
        plan.update({"self_attn.k_proj": ColwiseParallel(),
                     "self_attn.v_proj": ColwiseParallel()})
    for layer in tp.model.layers:
        parallelize_module(layer, mesh, plan)
    w1 = geoscale_fx.wrap(single, compiler="aot_eager", estimator="exact")
    w2 = geoscale_fx.wrap(tp, compiler="aot_eager", estimator="exact")
    with torch.no_grad():
        diff = (w1(x).logits - w2(x).logits).abs().max().item()
    assert diff < 1e-4, diff
    for layer in range(1):
        key = f"model_layers_{layer}_self_attn"
        full = w1.geoscale.records[key].state.scale
        scale = w2.geoscale.records[f"{key}_tp{rank}"].state.scale
        torch.testing.assert_close(scale, full[mine], rtol=1e-6, atol=0)
    assert counters["geoscale"]["left_as_is"] == 0


def _tp_hf_llama_sharded_kv(rank, world):
    _tp_hf_llama(rank, world, n_kv=2)      # GQA 4/2: one kv head per rank


def _tp_hf_llama_replicated_kv(rank, world):
    _tp_hf_llama(rank, world, n_kv=1)      # fewer kv heads than ranks: k/v replicated


@functools.lru_cache(maxsize=None)
def _compile_reads_exporting() -> bool:
    """Whether ``torch.compiler.is_exporting()`` reads True inside plain ``torch.compile``.
    torch 2.11's Dynamo folds it to the constant True; 2.12.1, 2.13, 2.14.1 and 2.15 read
    the export flag (pytorch#176499) and answer False."""
    seen: list[bool] = []

    def probe(x):
        seen.append(torch.compiler.is_exporting())
        return x + 1

    torch.compile(probe, backend="eager")(torch.ones(1))
    return seen[0]


#: why the replicated-kv configuration cannot compile where ``_compile_reads_exporting()``
REPLICATED_KV_UNDER_2_11 = (
    "torch 2.11's Dynamo reads torch.compiler.is_exporting() as True under torch.compile, so "
    "transformers 5.24 (masking_utils._ignore_causal_mask_sdpa) builds the causal mask; with a "
    "mask on CPU, sdpa_attention_forward repeats k/v by the config's num_key_value_groups (4) "
    "instead of passing enable_gqa, and a rank's 2 local q heads meet 4 kv heads: SDPA's "
    "shapes do not broadcast. Plain torch.compile of this TP model fails the same way "
    "(no geoscale involved); torch >= 2.12 reads False and the causal mask is skipped")


def _llama(n_kv: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=n_kv, intermediate_size=128,
                                   vocab_size=VOCAB, max_position_embeddings=64,
                                   attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _hf_tp_plan_auto(rank, world, path):
    import transformers

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    tp = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    single = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    weight = tp.model.layers[0].self_attn.q_proj.weight
    assert tuple(weight.placements) == (dist.tensor.Shard(0),), weight.placements
    w1 = geoscale_fx.wrap(single, compiler="aot_eager", estimator="exact")
    w2 = geoscale_fx.wrap(tp, compiler="aot_eager", estimator="exact")
    x = _tokens(4, length=7)
    with torch.no_grad():
        diff = (w1(x).logits - w2(x).logits).abs().max().item()
    assert diff < 1e-4, diff
    # transformers computes with W.to_local(): the site still knows it holds heads 2r, 2r+1
    key = "model_layers_0_self_attn"
    record = w2.geoscale.records[f"{key}_tp{rank}"]
    assert record.site.shard.q_heads == (2 * rank, 2 * rank + 1)
    torch.testing.assert_close(record.state.scale,
                               w1.geoscale.records[key].state.scale[2 * rank:2 * rank + 2],
                               rtol=1e-6, atol=0)


def test_hf_tp_plan_auto(two_ranks):
    """transformers' own plan (``tp_plan="auto"``: colwise q/k/v, rowwise o, computing with
    the local shards) on CPU/gloo: every site rewritten, each rank the scales of its heads."""
    pytest.importorskip("transformers")
    two_ranks(_hf_tp_plan_auto)


@pytest.mark.parametrize("kv", ["sharded_kv", "replicated_kv"])
def test_tensor_parallel_hf_llama_gqa_and_replicated_kv(two_ranks, kv):
    """HF Llama (RoPE, GQA 4/2) with q/k/v colwise: same per-head scales as one process; with
    one kv head (fewer than ranks) k/v stay replicated and each rank pairs its q heads."""
    pytest.importorskip("transformers")
    if kv == "replicated_kv" and _compile_reads_exporting():
        pytest.skip(REPLICATED_KV_UNDER_2_11)
    two_ranks(globals()[f"_tp_hf_llama_{kv}"])


# --------------------------------------------------------------------------------------
# FSDP2, and FSDP2 x TP
# --------------------------------------------------------------------------------------

#: what a rank observed of its own batch's logits (explicit lowering), not what sets the scale
OBSERVED = {"amax", "max_scaled", "max_scaled_ever", "overflow_heads", "overflow_steps"}


def _state_identical_across(backend, group=None) -> None:
    """Every state tensor that sets the scale, of every site, bit-identical on every rank of
    ``group`` (the observed maxima describe each rank's own batch)."""
    for key, record in sorted(backend.records.items()):
        for name, t in record.state.as_dict().items():
            if name in OBSERVED:
                continue
            copies = _gathered(t.detach().float(), group)
            assert all(torch.equal(copies[0], c) for c in copies), (key, name, copies)


def _fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import geoscale_fx.compile.dynamo_backend as backend_module   # compiles a graph with its aot_eager

    mesh = init_device_mesh("cpu", (world,))
    collectives: list[int] = []
    backend_module.aot_eager = _count_collectives(collectives)
    single, sharded = _gpt(), _gpt()
    be1 = geoscale_fx.compile_blocks(single, single.transformer.h, compiler="aot_eager")
    be2 = geoscale_fx.compile_blocks(sharded, sharded.transformer.h, compiler="aot_eager")
    for block in sharded.transformer.h:        # torchtitan's order: compile, then shard
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (single, sharded)]
    torch.manual_seed(100 + rank)  # ranks seeded apart (dropout): the state must not care
    for step in range(3):
        x, y = _tokens(step, batch=4), _tokens(step + 10, batch=4)
        loss1 = single(x, y)[1]
        loss2 = sharded(x.chunk(world)[rank], y.chunk(world)[rank])[1]
        for loss, opt in zip((loss1, loss2), opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        mean = loss2.detach().clone()
        dist.all_reduce(mean)
        assert abs(loss1.item() - mean.item() / world) < 1e-5, (step, loss1, mean)
    # one compiled block graph serves both blocks; the state is per block, the same on
    # every rank by construction (same unsharded weights, key-seeded cold start)
    assert be2.compiles == 1 and sorted(be2.records) == sorted(be1.records)
    assert [r["site"] for r in geoscale_fx.report(sharded).rows] == [
        "transformer.h.0.attn", "transformer.h.1.attn"]
    _state_identical_across(be2)
    for key in be1.records:
        torch.testing.assert_close(be2.records[key].state.scale, be1.records[key].state.scale,
                                   rtol=1e-4, atol=0)
    # FSDP2's hooks run outside the compiled graphs: no collective in them at all
    assert collectives and set(collectives) == {0}, collectives
    # mixed precision: the bound is that of the bf16 weights the block computes with
    model = _gpt(bias=False)
    reference = copy.deepcopy(model).to(torch.bfloat16).float()
    backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager",
                                         estimator="exact")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    with torch.no_grad():
        model(_tokens(5))
    _state_identical_across(backend)
    for b in range(2):
        scale = backend.records[f"transformer_h_{b}_attn"].state.scale.double()
        ref = torch.tensor([_reference_scale(reference, b, [h]) for h in range(N_HEAD)],
                           dtype=torch.float64)
        torch.testing.assert_close(scale, ref, rtol=1e-5, atol=0)


def test_fsdp2_trains_like_one_process_with_identical_state(two_ranks):
    """Per-block compile, then fully_shard: three AdamW steps with the single-process losses,
    bit-identical scaling state on both ranks, no collective in the compiled graphs; with
    MixedPrecisionPolicy(bf16) the scales are the float64 bounds of the bf16 weights."""
    two_ranks(_fsdp2)


def _train_2d(model, x, y, dp: int = 0, world_dp: int = 1, group=None) -> list[float]:
    """Two AdamW steps on this data-parallel rank's half of the batch; the mean losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(x.chunk(world_dp)[dp], y.chunk(world_dp)[dp])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if group is not None:
            dist.all_reduce(mean, group=group)
        losses.append(mean.item() / world_dp)
    return losses


def _fsdp_tp(rank, world, reference: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    model = _parallelize(_gpt(n_layer=1), mesh["tp"])
    backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager",
                                         estimator="exact")
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    losses = _train_2d(model, _tokens(0, batch=4), _tokens(1, batch=4), dp, 2,
                       mesh["dp"].get_group())
    assert max(abs(a - b) for a, b in zip(losses, reference["losses"])) < 1e-5, \
        (losses, reference["losses"])
    assert sorted(backend.records) == [f"transformer_h_0_attn_tp{tp}"]
    _state_identical_across(backend, mesh["dp"].get_group())     # data-parallel replicas
    torch.testing.assert_close(backend.records[f"transformer_h_0_attn_tp{tp}"].state.scale,
                               reference["scale"][2 * tp:2 * tp + 2], rtol=1e-4, atol=0)


def test_fsdp2_x_tensor_parallel_2d_mesh():
    """4 processes, mesh (dp=2, tp=2): the single-process losses (computed here, once);
    each TP rank holds the single-process scales of its heads, identical on its
    data-parallel replica."""
    single = _gpt(n_layer=1)
    backend = geoscale_fx.compile_blocks(single, single.transformer.h, compiler="aot_eager",
                                         estimator="exact")
    losses = _train_2d(single, _tokens(0, batch=4), _tokens(1, batch=4))
    reference = {"losses": losses, "scale": backend.records["transformer_h_0_attn"]
                 .state.scale.clone()}
    _spawn(_fsdp_tp, 4, reference)


# --------------------------------------------------------------------------------------
# Checkpoints (DCP)
# --------------------------------------------------------------------------------------

def _built(kind: str, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _gpt()
    if kind == "tp":
        _parallelize(model, mesh)
    backend = geoscale_fx.compile_blocks(model, model.transformer.h, compiler="aot_eager")
    if kind == "fsdp":
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, backend


def _resumed(model, backend, path) -> dict[str, torch.Tensor]:
    """A fresh model: scaling state and weights from ``path``, then one forward."""
    import torch.distributed.checkpoint as dcp

    cold = counters["geoscale"]["cold_starts"]
    assert geoscale_fx.load_scaling_state(model, path) > 0
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    with torch.no_grad():
        model(_tokens(9))
    assert counters["geoscale"]["cold_starts"] == cold, "resumed cold"
    return _scales(backend)


def _dcp(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for kind in ("tp", "fsdp"):
        model, backend = _built(kind, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            model(_tokens(step), _tokens(step + 1))[1].backward()
            opt.step()
            opt.zero_grad()
        target = os.path.join(path, kind)
        dcp.save(model.state_dict(), checkpoint_id=target)
        with torch.no_grad():      # what the next step computes, with this very state
            model(_tokens(9))
        expected = _scales(backend)
        got = _resumed(*_built(kind, mesh), target)
        assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
        for key in got:
            assert torch.equal(got[key], expected[key]), (kind, key, got[key], expected[key])
        if kind == "fsdp" and rank == 0:
            torch.save(expected, os.path.join(path, "expected.pt"))


def test_dcp_round_trip_resumes_warm(two_ranks):
    """Save on 2 ranks (TP; FSDP2), load on 2 ranks into fresh compiled models: no cold
    start, the very scales the saved model computes next; the FSDP2 checkpoint also loads
    into one process."""
    tmp_path = two_ranks(_dcp) / "dcp"
    model, backend = _built("single", None)
    got = _resumed(model, backend, str(tmp_path / "fsdp"))
    expected = torch.load(tmp_path / "expected.pt")
    assert sorted(got) == sorted(expected)
    for key in got:
        assert torch.equal(got[key], expected[key]), (key, got[key], expected[key])