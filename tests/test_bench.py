"""The benchmark's scenario functions on a tiny model (seconds each)."""
import json

import pytest
import torch

models_zoo = pytest.importorskip("models_zoo")

from bench.lms import BenchLM  # noqa: E402
from bench.methods import TRANSIENT_METHODS  # noqa: E402
from bench.runner import Context, Scenario, ScenarioResult, run_scenarios  # noqa: E402
from bench.scenarios import (  # noqa: E402
    SCENARIOS, calibration, decoding, performance, tables, transients,
)


@pytest.fixture(scope="module")
def tiny_lm():
    """A 2-layer nanoGPT trained for a few steps on bytes: the 'pretrained checkpoint'."""
    from models_zoo.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=2, n_embd=64)
    model = GPT(config)
    data = torch.randint(0, 32, (4096,))
    gen = torch.Generator().manual_seed(0)

    def batch(g, size, seq, split="train"):
        start = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
        x = torch.stack([data[s:s + seq] for s in start.tolist()])
        y = torch.stack([data[s + 1:s + seq + 1] for s in start.tolist()])
        return {"idx": x, "targets": y}

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        model(**batch(gen, 8, 64))[1].backward()
        opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def build():
        fresh = GPT(config)
        fresh.load_state_dict(state)
        return fresh.eval()

    return BenchLM("tiny", build, batch)


@pytest.fixture
def ctx(tiny_lm, tmp_path):
    """The scenarios on the tiny LM, geoscale's rewritten graphs run eagerly (compiler
    "eager": no AOT trace, the same numbers; the compiled paths have their own tests)."""
    return Context(profile="quick", out_dir=tmp_path, lms={"tiny": lambda: tiny_lm},
                   models=("tiny",), compiler="eager", timing_compiler="eager",
                   step_scale=0.2, sweep_lengths=(256,), progress=False)


def _rows_have(result: ScenarioResult, *fields):
    assert result.rows and result.error is None
    for row in result.rows:
        for f in fields:
            assert f in row, (f, row)


def test_first_forward_geometry_never_overflows_delayed_always_does(ctx):
    result = transients.first_forward(ctx)
    _rows_have(result, "model", "method", "overflowing layers", "max scaled logit", "max |S|")
    by_method = {r["method"]: r for r in result.rows}
    assert set(by_method) == set(TRANSIENT_METHODS)
    assert by_method["geometry/head"]["overflowing layers"] == "0/2"
    assert by_method["geometry/layer"]["overflowing layers"] == "0/2"
    # history 1.0 → scale 1/(448·0.9): a layer overflows once its max|S| exceeds 1.11
    assert by_method["delayed/paper"]["overflowing layers"] in ("1/2", "2/2")
    assert by_method["delayed/paper"]["max scaled logit"] > 448


@pytest.mark.parametrize("scenario", [transients.resume, transients.lr_spike])
def test_training_transients_report_zero_geometry_overflows(ctx, scenario):
    result = scenario(ctx)
    _rows_have(result, "model", "method", "overflow steps", "max scaled logit",
               "non-finite steps")
    for row in result.rows:
        if row["method"].startswith("geometry"):
            assert row["overflow steps"] == 0
            assert row["non-finite steps"] == 0


def test_weight_spike_geometry_rescales_in_the_same_pass(ctx):
    result = transients.weight_spike(ctx)
    _rows_have(result, "max scaled before", "max scaled at spike", "overflow at spike",
               "scale before", "scale at spike")
    rows = {r["method"]: r for r in result.rows}
    for method in ("geometry/head", "geometry/layer"):
        assert not rows[method]["overflow at spike"]
        # q and k weights ×4 → the bound, hence the scale, grows ~16× in the same step
        assert rows[method]["scale at spike"] > 10 * rows[method]["scale before"]
    assert rows["delayed/paper"]["max scaled at spike"] > rows["delayed/paper"][
        "max scaled before"]
    assert (ctx.out_dir / "weight_spike.png").stat().st_size > 1000
    assert len(result.data["spike"]["series"]["current"]["scale"]) == 20


def test_overhead_and_sweep_report_ratios_and_memory(ctx):
    result = performance.overhead(ctx)
    _rows_have(result, "method", "fwd ms", "fwd ratio", "fwd compile s", "fwd spread",
               "fwd vs 1.03")
    assert result.rows[0]["method"] == "plain inductor"
    assert all(r["fwd vs 1.03"] in ("meets", "misses", "undecided") for r in result.rows)
    assert {r["method"] for r in result.rows if "step ratio" in r} >= {
        "plain inductor", "geometry/head", "delayed/paper"}
    assert result.rows[0]["fwd ratio"] == pytest.approx(1.0)
    assert "step ratio" in result.rows[1]
    sweep = performance.seq_len_sweep(ctx)
    _rows_have(sweep, "seq len", "method", "forward ms", "peak MB", "scores MB")
    assert {r["method"] for r in sweep.rows} == {"geometry fused", "geometry explicit",
                                                 "current"}
    assert (ctx.out_dir / "seq_len_sweep.png").exists()


def test_utilization_and_quality(ctx):
    util = calibration.utilization(ctx)
    _rows_have(util, "method", "median %", "P10 %", "P90 %", "overflow steps")
    assert [r["method"] for r in util.rows] == [
        "delayed/paper", "geometry (default: schatten)", "geometry, power iteration",
        "geometry theory-alpha", "geometry auto-alpha"]
    for row in util.rows:
        assert 0 <= row["P10 %"] <= row["median %"] <= row["P90 %"]
    exact, power = util.rows[1], util.rows[2]     # power: a lower bound of σ, a larger share
    assert exact["median %"] <= power["median %"] * 1.001 and exact["overflow steps"] == 0
    quality = calibration.quality(ctx)
    _rows_have(quality, "method", "val loss before", "val loss after", "overflow steps")
    assert quality.rows[0]["method"] == "none"


def test_inference_reports_tokens_per_second_ratios_and_decode_overflows(ctx, monkeypatch):
    """Scenario 11 on the tiny nanoGPT (its tuple cache): per batch, plain / geometry /
    current with ratios to plain; geometry's audit pass over the decode calls: no overflow,
    the largest scaled logit within η·R_max. (compiler "eager": the same graphs, compiled
    in a third of aot_eager's time; both batch sizes of the full profile.)"""
    import dataclasses

    monkeypatch.setattr(decoding, "QUICK_BATCHES", decoding.BATCHES)
    result = decoding.inference(dataclasses.replace(ctx, compiler="eager",
                                                    timing_compiler="eager"))
    _rows_have(result, "model", "batch", "method", "tokens/s", "ratio", "compile s",
               "max scaled", "overflows", *QUALITY_COLUMNS)
    assert [(r["batch"], r["method"]) for r in result.rows] == [
        (b, m) for b in (1, 8) for m in ("plain inductor", "geometry", "current")]
    # block_size 128: a 64-token prompt, 64 new tokens (× step_scale 0.2 in tests: 13)
    assert "13 tokens after a 64-token prompt" in result.title
    for row in result.rows:
        assert row["tokens/s"] > 0
        _check_quality(row, seeds=decoding.QUALITY_SEEDS, sequences=row["batch"],
                       new=13, reference=row["method"] == "plain inductor")
        if row["method"] == "plain inductor":
            assert row["ratio"] == pytest.approx(1.0)
        if row["method"] == "geometry":
            assert row["overflows"] == 0
            assert 0 < row["max scaled"] <= 0.8 * 448 * (1 + 1e-6)
            assert row["max |S|"] > row["max scaled"] * 1e-6
        if row["method"] == "current":
            assert row["overflows"] == 0 and row["max scaled"] == pytest.approx(448, rel=1e-3)
    series = result.data["geometry_max_scaled"]
    assert [len(v) for v in series.values()] == [12, 12]     # decode calls: new tokens - 1
    assert (ctx.out_dir / "inference.png").stat().st_size > 1000
    # batch 1: nothing couples sequences, so free-running greedy decoding first differs from
    # plain exactly where teacher forcing first disagrees on the top-1 token
    for method, found in result.data["quality"]["tiny b1"].items():
        assert found["divergence"] == found["flip"], method


QUALITY_COLUMNS = ("logit rel. L2", "KL/token", "top-1 agree", "first divergence",
                   "identical")


def _check_quality(row, *, seeds: int, sequences: int, new: int, reference: bool):
    """The quality columns of scenarios 11/12: spreads over ``seeds`` prompts (divergence:
    over every generated sequence), in range; the reference's own row is exact."""
    rel, kl, top1, div = (row[c] for c in QUALITY_COLUMNS[:4])
    assert rel.n == kl.n == top1.n == seeds and div.n == seeds * sequences
    assert 0 <= rel.low <= rel.median <= rel.high < 1
    assert 0 <= kl.low <= kl.median <= kl.high
    assert 0 <= top1.low <= top1.median <= top1.high <= 1
    assert all(d is None or 0 <= d < new for d in (div.low, div.median, div.high))
    assert row["identical"] == f"{div.none}/{div.n}"
    if reference:
        assert (rel.high, kl.high, top1.low) == (0.0, 0.0, 1.0)
        assert div.none == div.n


def test_decode_lengths_fill_the_context_up_to_the_issues_128_plus_128():
    assert decoding.decode_lengths(128) == (64, 64)
    assert decoding.decode_lengths(1024) == (128, 128)


def test_tables(ctx):
    alpha = tables.alpha_table(ctx)
    _rows_have(alpha, "model", "gamma", "alpha_min")
    assert alpha.rows[0]["alpha_min"] == pytest.approx(0.0735, abs=1e-4)
    norms = tables.spectral_norms(ctx)
    _rows_have(norms, "model", "mean", "max", "min", "max head (any layer)")
    assert len(norms.data["per_layer"]["tiny"]) == 2


def test_runner_reports_a_failing_scenario_and_keeps_going(ctx, capsys):
    def broken(_ctx):
        raise RuntimeError("boom")

    def fine(_ctx):
        return ScenarioResult("fine", "fine", rows=[{"x": 1}])

    results = run_scenarios([Scenario("broken", "broken", broken),
                             Scenario("fine", "fine", fine)], ctx)
    assert results[0].error == "RuntimeError: boom" and results[1].error is None
    out = capsys.readouterr().out
    assert "FAILED" in out and "boom" in out
    payload = json.loads((ctx.out_dir / "results.json").read_text())
    assert [s["key"] for s in payload["scenarios"]] == ["broken", "fine"]
    assert "**Failed**" in (ctx.out_dir / "report.md").read_text()


def test_untimed_scenarios_run_in_processes_of_their_own_before_the_timed_ones(tmp_path,
                                                                               capsys):
    """``jobs=2``: the untimed scenarios in spawned processes, a thread share each, no
    progress bars there; a failure in one is its result; the timed one in this process,
    after them; the results and files in the scenarios' order."""
    import os

    from tests import bench_runner_scenarios as functions

    def scenario(key, fn, **kwargs):
        return Scenario(key, f"{key} title", fn, **kwargs)

    ctx = Context(out_dir=tmp_path, progress=True)
    results = run_scenarios([scenario("a", functions.a),
                             scenario("timed", functions.timed, timed=True),
                             scenario("broken", functions.fails),
                             scenario("c", functions.c)], ctx, jobs=2)
    (a,), (timed,), (c,) = results[0].rows, results[1].rows, results[3].rows
    assert [r.key for r in results] == ["a", "timed", "broken", "c"]
    assert results[2].error == "RuntimeError: boom" and results[2].rows == []
    assert a["pid"] != os.getpid() and c["pid"] != os.getpid() and timed["pid"] == os.getpid()
    assert a["threads"] == c["threads"] == max(1, torch.get_num_threads() // 2)
    assert not a["progress"] and timed["progress"]
    assert timed["start"] >= max(a["end"], c["end"])
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [s["key"] for s in payload["scenarios"]] == ["a", "timed", "broken", "c"]
    out = capsys.readouterr().out
    assert out.index("=== timed title") > max(out.index("=== a title"), out.index("=== c title"))
    assert "FAILED: RuntimeError: boom" in out


def test_an_interrupt_ends_the_scenario_processes_still_running(tmp_path):
    """Ctrl-C while the untimed scenarios run (here: raised where the first table prints)
    ends the process still running a scenario, instead of waiting for it to finish."""
    import os
    import time

    from tests import bench_runner_scenarios as functions

    def echo(line):
        if "=== first title" in line:
            raise KeyboardInterrupt

    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_scenarios([Scenario("first", "first title", functions.waits_for_the_sleeper),
                       Scenario("sleeper", "sleeper title", functions.sleeps)],
                      Context(out_dir=tmp_path, progress=False), echo=echo, jobs=2)
    assert time.perf_counter() - start < 100      # the sleeper sleeps 120 s
    pid = int((tmp_path / "sleeper.pid").read_text())
    with pytest.raises(ProcessLookupError):       # ended and reaped
        os.kill(pid, 0)


def test_scenarios_are_registered():
    assert len(SCENARIOS) == 14
    assert len({s.key for s in SCENARIOS}) == 14
    assert [s.key for s in SCENARIOS if not s.default] == ["distributed", "rl"]   # --only
    assert [s.key for s in SCENARIOS if s.timed] == ["overhead", "seq-len", "inference",
                                                     "distributed", "rl"]
    assert [s.title.split(".")[0] for s in SCENARIOS] == [str(i) for i in range(1, 15)]


def test_distributed_scenario_times_two_ranks_against_one_process(tmp_path):
    """Scenario 13 on a reduced set: per-rank step times and both ratios, from one run."""
    import math

    pytest.importorskip("torch.distributed")
    from bench.scenarios import distributed

    ctx = Context(out_dir=tmp_path, timing_compiler="aot_eager", step_scale=0.2,
                  progress=False)
    configs = {"one process": ("plain", "geometry/head"), "TP 2": ("plain", "geometry/head")}
    rows = distributed.measure(ctx, configs)
    assert sorted((r["config"], r["method"], r["rank"]) for r in rows) == sorted(
        [("one process", m, 0) for m in configs["one process"]]
        + [("TP 2", m, rank) for m in configs["TP 2"] for rank in (0, 1)])
    for row in rows:
        assert row["step ms"] > 0 and math.isfinite(row["vs one process"]), row
        assert row["vs plain"] == 1.0 if row["method"] == "plain" else row["vs plain"] > 0


def test_fp8_kv_cache_compares_four_scale_sources_before_and_after_fine_tuning(tmp_path,
                                                                            monkeypatch):
    """Scenario 12 on a tiny HF Llama (a DynamicCache): geometry never saturates, unit scales
    use almost none of the FP8 range, the cache takes half a bf16 cache's bytes, and the
    fine-tuning phase changes the weights. Its FP8 q/k/v table on one family (GPT-2, both
    caches; every family's errors are checked in tests/test_fp8_qkv.py): every call runs
    FP8 q/k/v, no fallback, no overflow."""
    from bench.scenarios import kv_cache
    from tests.hf_models import build_hf

    monkeypatch.setattr(kv_cache, "QKV_FAMILIES", (("gpt2", "MHA, fused c_attn"),))

    state = build_hf("llama-sdpa").state_dict()

    def build():
        model = build_hf("llama-sdpa")
        model.load_state_dict(state)
        return model

    def batch(g, size, seq, split="train"):
        ids = torch.randint(1, 128, (size, min(seq, 24)), generator=g)
        return {"input_ids": ids, "labels": ids}

    lm = BenchLM("tiny-llama", build, batch)
    ctx = Context(out_dir=tmp_path, lms={"tiny-llama": lambda: lm}, models=("tiny-llama",),
                  compiler="eager", step_scale=0.1, progress=False)
    result = kv_cache.fp8_kv_cache(ctx)
    _rows_have(result, "model", "phase", "method", "cache MB", "vs bf16", "saturated",
               *QUALITY_COLUMNS, "max |x|/scale / R_max")
    assert [(r["phase"], r["method"]) for r in result.rows] == [
        (p, m) for p in ("pretrained", "fine-tuned") for m in kv_cache.METHODS]
    new = int(result.title.split("decoding of ")[1].split()[0])
    for row in result.rows:
        _check_quality(row, seeds=kv_cache.SEEDS, sequences=4, new=new, reference=False)
        assert row["logit rel. L2"].low > 0 and row["KL/token"].low > 0   # E4M3 rounds
        if row["method"] == "geometry":
            assert row["saturated"] == 0 and 0.05 < row["max |x|/scale / R_max"] < 1
            assert row["vs bf16"] == pytest.approx(0.5)
        if row["method"] == "unit (1.0)":
            assert row["max |x|/scale / R_max"] < 0.05
    assert result.data["key_weight_change"]["tiny-llama"] > 0
    assert (tmp_path / "fp8_kv_cache.png").stat().st_size > 1000
    qkv = result.data["fp8_qkv_decode"]
    assert [(r["family"], r["cache"]) for r in qkv] == [
        ("gpt2 (MHA, fused c_attn)", cache) for cache in ("dynamic", "static")]
    for row in qkv:
        fp8_calls, calls = row["calls fp8_qkv / all"].split("/")
        assert fp8_calls == calls and int(calls) >= 2, row
        assert row["fallbacks"] == 0 and row["overflows (geoscale)"] == 0, row
        assert 0 < row["rel. L2 geoscale"] <= 1.5 * row["rel. L2 ideal dynamic"] + 1e-3, row
