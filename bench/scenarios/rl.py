"""Scenario 14: RL rollouts with an FP8 KV cache — seven sources of k/v scales, two models.

TRL's ``GRPOTrainer`` trains a pretrained zoo LM (byte level) in full precision, as RL
trainers do; the FP8 KV cache is the serving engine's. Every rollout after the first is the
moment an RL loop has just synced its engine: the policy's weights go into a plain copy of the model (the engine), and each
source (``bench.scenarios.rl_sources``) gives the engine's per-layer ``k_scale``/``v_scale``
for this sync — geoscale's from the weights, frozen ones, NeMo-RL's p99.9 × 1.05 and a max-abs
recalibration over the trainer's batch (the previous rollouts, the batch the trainer just
stepped on, at the synced weights), a static min-max calibration before training, 1.0, or no
FP8. On the tokens the policy has just sampled (the rollouts this sync's engine would have
produced), the engine's forward through an FP8 cache with each source's scales gives
log-probabilities that are compared with the trainer's (the engine's forward without a cache,
what the policy loss differentiates): ``bench.rl_metrics``. One forward through the cache
reads, at every position, the same dequantized keys and values a token-by-token decode reads
(tests check it), at one call instead of one per token; the FP8 sources go through one
forward together, each in its own rows of the batch (``batched_fp8_cache``, tested against
geoscale's FP8 cache).

Two models, each in its own GRPO run from the same pretrained weights: the zoo LM (keys and
values of order 1) and the same LM with its keys ×256 and its softmax scale /256
(``bench.lms.large_key_lm``: the same logits, keys beyond E4M3's 448 at scale 1.0, as real
checkpoints' are, e.g. Qwen2's). Per sync also: wall time of each source's work on this
machine (``attention_scales`` of the updated policy; the calibration forward and its
statistic) and the key and value projections' relative change since step 0. FLOPs at 7B
shapes: ``bench.sync_cost``. ``python -m bench --only rl`` (``--full``: 30 steps per model).
"""
from __future__ import annotations

import logging
import time

import torch
from transformers import DynamicCache

import geoscale_fx
from bench.lms import large_key_lm, projection_drift, projection_snapshot
from bench.rl_metrics import GEOMETRIC_BAND, TIS_CAP, log_ratio_tails, token_log_ratios
from bench.scenarios.rl_sources import (
    MARGIN, PERCENTILE, SOURCES, engine_layer_scales, max_abs_scales, observed_kv,
    percentile_scales, unit_scales,
)
from bench.runner import Context, ScenarioResult
from bench.scenarios.batched_fp8_cache import FMT, batched_fp8_cache, range_used
from bench.scenarios.kv_cache import _shifted
from bench.sync_cost import RL_BATCH, SHAPES, calibration_flops, geoscale_flops
from geoscale_fx.kv_cache.manager import cache_argument

__all__ = ["rl_rollouts", "SOURCES", "KEY_FACTOR", "BAND_ROW", "rollout_logits",
           "seven_sources"]

log = logging.getLogger("bench")

#: bytes per prompt and per completion; prompts and completions per step
PROMPT_LEN, COMPLETION_LEN, PROMPTS, GENERATIONS = 24, 24, 2, 4
KEY_FACTOR = 256.0
#: the 7B shape whose FLOPs per sync the table gives
FLOP_SHAPE = "Llama-2-7B"
#: geoscale's scales are also measured × 2^(k/4) for these k: the rounding-noise band
BAND = (1, 2, 3)
BAND_ROW = "geoscale × 2^(k/4), k = 0..3"
#: table column -> bench.rl_metrics.log_ratio_tails key
COLUMNS = {"mean |Δ log p|": "mean", "p99.9 |Δ log p|": "p99.9", "max |Δ log p|": "max",
           "seq |ΣΔ| p99": "seq p99", "seq |ΣΔ| max": "seq max", "tokens w>2": "tokens w > 2",
           "seqs w∉[½,2]": "seqs w outside [1/2, 2]",
           "seqs geo∉band": "seqs outside geometric band"}


def _tokenizer():
    """A transformers tokenizer with the zoo's byte ids (0–255; byte 0 ends and pads)."""
    import tokenizers
    import transformers

    vocab = {chr(i): i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=chr(0)))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chr(0),
                                                pad_token=chr(0))


def _prompts(lm, ctx: Context, count: int):
    import datasets

    ids = lm.batch(ctx.generator(14), count, PROMPT_LEN, "val")["input_ids"]
    return datasets.Dataset.from_dict({"prompt": ["".join(chr(int(b)) for b in row if int(b))
                                                  for row in ids]})


def _reward(completions, **_) -> list[float]:
    """Python-looking completions: the share of lowercase letters and spaces, and a point
    per ``self`` (a reward that varies within every group, so every step moves weights)."""
    return [sum(ch.islower() or ch == " " for ch in c) / max(len(c), 1) + c.count("self")
            for c in completions]


def rollout_logits(engine, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits ``(B, T - PROMPT_LEN, V)`` predicting ``tokens[:, PROMPT_LEN:]``, through
    ``cache`` (None: no cache, the trainer's forward)."""
    passed = {} if cache is None else {"use_cache": True, cache_argument(): cache}
    with torch.no_grad():
        return engine(tokens, **passed).logits[:, PROMPT_LEN - 1:-1].float()


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def seven_sources(engine, policy, trainer_batch: torch.Tensor, static: tuple
                  ) -> tuple[list, dict]:
    """Each source's layer scales for this sync (None: no FP8), in ``SOURCES`` order, and
    the seconds each recalibrating source spent on it."""
    scales, geo_s = _timed(geoscale_fx.attention_scales, policy)
    kv, forward_s = _timed(observed_kv, engine, trainer_batch)
    percentile, pct_s = _timed(percentile_scales, kv)
    max_abs, max_s = _timed(max_abs_scales, kv)
    layers = engine_layer_scales(engine, scales)
    found = [layers, static[0], percentile, max_abs, static[1], unit_scales(len(layers)), None]
    seconds = {SOURCES[0]: geo_s, SOURCES[2]: forward_s + pct_s, SOURCES[3]: forward_s + max_s}
    return found, seconds


def _measure(engine, policy, tokens, trainer_batch, static: tuple) -> dict:
    """One sync: every source's log-ratios, saturations and range on the same tokens, the
    FP8 sources and the band in one batch (``batched_fp8_cache``)."""
    engine.load_state_dict(policy.state_dict())
    scale_sets, seconds = seven_sources(engine, policy, trainer_batch, static)
    trainer = rollout_logits(engine, tokens, None)
    fp8 = [(source, scales) for source, scales in zip(SOURCES, scale_sets) if scales is not None]
    fp8 += [(f"band {k}", _shifted(scale_sets[0], 2 ** (k / 4))) for k in BAND]
    cache = batched_fp8_cache(engine.config, [scales for _, scales in fp8], len(tokens))
    logits = rollout_logits(engine, tokens.repeat(len(fp8), 1), cache).split(len(tokens))
    used = range_used(cache)
    found = {"seconds": seconds}
    for g, ((name, scales), rollout) in enumerate(zip(fp8, logits)):
        delta = token_log_ratios(trainer, rollout, tokens[:, PROMPT_LEN:])
        found[name] = delta if name.startswith("band ") else _summarized(
            delta, int(cache.saturated[g].sum()), float(used[g]),
            max(float(s.scales(FMT)[0].max()) for s in scales))
    plain = rollout_logits(engine, tokens, DynamicCache(config=engine.config))
    found["no FP8"] = _summarized(token_log_ratios(trainer, plain, tokens[:, PROMPT_LEN:]),
                                  0, None, None)
    return found


def _summarized(delta: torch.Tensor, saturated: int, used, max_k_scale) -> dict:
    return {"delta": delta, "mean": float(delta.abs().mean()),
            "max": float(delta.abs().max()), "seq max": float(delta.sum(-1).abs().max()),
            "saturated": saturated, "range used": used, "max k scale": max_k_scale}


class _Syncs:
    """Wraps the policy's ``generate`` (what TRL's rollouts call): each rollout after the
    first is measured against the sync before it (``_measure``), its trainer's batch the
    rollout before."""

    def __init__(self, policy, engine, static: tuple, start: list, bar):
        self.per_sync: list[dict] = []
        self.previous = None
        generate = policy.generate

        def recorded(*args, **kwargs):
            out = generate(*args, **kwargs)
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            tokens = sequences[:, :PROMPT_LEN + COMPLETION_LEN]
            if self.previous is not None:
                found = _measure(engine, policy, tokens, self.previous, static)
                drift = projection_drift(engine, start)
                self.per_sync.append({"sync": len(self.per_sync) + 1, "key drift": drift["k"],
                                      "value drift": drift["v"], **found})
                bar.update(1)
            self.previous = tokens
            return out

        policy.generate = recorded


def _static_sources(lm, ctx: Context, policy, engine) -> tuple:
    """Before training: geoscale's scales (traced once) and a min-max calibration over
    text (llm-compressor's static KV scales); the seconds of each."""
    probe = torch.arange(1, 9).reshape(1, 8)
    frozen, trace_s = _timed(geoscale_fx.attention_scales, policy, probe)
    calibration = lm.batch(ctx.generator(15), 8, 64, "val")["input_ids"]
    kv, calibrate_s = _timed(observed_kv, engine, calibration)
    return (engine_layer_scales(engine, frozen), max_abs_scales(kv)), trace_s, calibrate_s


def _train(lm, ctx: Context, steps: int, lr: float) -> dict:
    """One GRPO run of ``lm`` with its syncs measured."""
    import trl

    policy, engine = lm.build(), lm.build()
    static, trace_s, calibrate_s = _static_sources(lm, ctx, policy, engine)
    start = projection_snapshot(engine)
    bar = ctx.bar(steps - 1, f"rl {lm.name}")
    syncs = _Syncs(policy, engine, static, start, bar)
    config = trl.GRPOConfig(
        output_dir=str(ctx.out_dir / "rl"), per_device_train_batch_size=PROMPTS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=COMPLETION_LEN, max_steps=steps,
        generation_kwargs={"min_new_tokens": COMPLETION_LEN},    # full-length completions
        learning_rate=lr, lr_scheduler_type="constant", report_to=[], use_cpu=True,
        # the default optimizer (adamw_torch_fused): its steps leave the weights' version
        # counters as they were, which geoscale's optimizer-step hook makes up for
        save_strategy="no", logging_steps=steps,
        gradient_checkpointing=False, seed=ctx.seed, disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=_reward, args=config,
                              train_dataset=_prompts(lm, ctx, 64), processing_class=_tokenizer(),
                              callbacks=[])
    trainer.train()
    bar.close()
    return {"per_sync": syncs.per_sync, "trace s": trace_s, "calibration s": calibrate_s}


def _summary(sync: dict) -> dict:
    """One sync for results.json: every number, no tensors."""
    return {k: ({n: x for n, x in v.items() if n != "delta"} if k in SOURCES else v)
            for k, v in sync.items() if not k.startswith("band ")}


def _digits(x: float) -> float:
    """Four significant digits (a table cell; results.json keeps the per-sync values)."""
    return float(f"{x:.4g}")


def _median(values: list[float]) -> float:
    ranked = sorted(values)
    return ranked[(len(ranked) - 1) // 2]


def _rows(name: str, run: dict) -> list[dict]:
    per_sync = run["per_sync"]
    shape = SHAPES[FLOP_SHAPE]
    flops = {SOURCES[0]: geoscale_flops(shape), SOURCES[2]: calibration_flops(shape, *RL_BATCH),
             SOURCES[3]: calibration_flops(shape, *RL_BATCH)}
    rows = []
    for source in SOURCES:
        tails = log_ratio_tails([s[source]["delta"] for s in per_sync])
        saturating = sum(1 for s in per_sync if s[source]["saturated"])
        used = [s[source]["range used"] for s in per_sync]
        timed = [s["seconds"][source] for s in per_sync if source in s["seconds"]]
        rows.append({
            "model": name, "source": source,
            **{column: _digits(tails[key]) for column, key in COLUMNS.items()},
            "saturated (syncs)": f"{sum(s[source]['saturated'] for s in per_sync)} "
                                 f"({saturating}/{len(per_sync)})",
            "range used": None if used[0] is None else _digits(_median(used)),
            "ms / sync": _digits(1e3 * _median(timed)) if timed else 0.0,
            "7B GFLOP / sync": _digits(flops.get(source, 0.0) / 1e9)})
    return rows + [_band_row(name, per_sync, rows[0])]


def _band_row(name: str, per_sync: list[dict], geoscale: dict) -> dict:
    """Each column's range over geoscale's scales × 2^(k/4), k = 0..3 (the geoscale row
    and ``BAND``): what moving the rounding grid alone does to it."""
    tails = [log_ratio_tails([s[f"band {k}"] for s in per_sync]) for k in BAND]
    row = {"model": name, "source": BAND_ROW}
    for column, key in COLUMNS.items():
        values = [geoscale[column]] + [t[key] for t in tails]
        row[column] = f"{min(values):.4g}–{max(values):.4g}"
    return row


def rl_rollouts(ctx: Context) -> ScenarioResult:
    """14. RL rollouts with an FP8 KV cache: rollout–trainer log-ratios per scale source."""
    import trl

    result = ScenarioResult("rl", "14. RL rollouts with an FP8 KV cache: rollout-trainer "
                                  "log-ratios per source of k/v scales")
    base = ctx.lm(ctx.models[0])       # one LM (causal_lms() builds every one in --full)
    steps, lr = ctx.steps(8, 30), 5e-4
    runs = {}
    for lm in (base, large_key_lm(base, KEY_FACTOR)):
        runs[lm.name] = _train(lm, ctx, steps, lr)
        result.rows += _rows(lm.name, runs[lm.name])
    result.data = {"lr": lr, "steps": steps,
                   "runs": {name: {**{k: v for k, v in run.items() if k != "per_sync"},
                                   "per_sync": [_summary(s) for s in run["per_sync"]]}
                            for name, run in runs.items()}}
    drift = "; ".join(f"{name}: keys {run['per_sync'][-1]['key drift']:.3g}, values "
                      f"{run['per_sync'][-1]['value drift']:.3g}" for name, run in runs.items())
    result.notes = _notes(steps, lr, trl.__version__, drift, runs)
    from bench.plots import rl_plot

    result.plots.append(rl_plot({n: r["per_sync"] for n, r in runs.items()}, SOURCES,
                                ctx.out_dir / "rl_rollouts.png"))
    return result


def _notes(steps: int, lr: float, trl_version: str, drift: str, runs: dict) -> str:
    one = next(iter(runs.values()))
    return (
        f"{steps} GRPO steps per model (TRL {trl_version}), lr {lr}, {PROMPTS}×{GENERATIONS} "
        f"completions of {COMPLETION_LEN} bytes per step; {steps - 1} syncs measured per model "
        f"(the rollouts after each update). Relative change of the key and value projections "
        f"(largest over layers) by the last sync: {drift}. Δ = log p(trainer) − "
        f"log p(rollout) of each sampled token, float64, over every token (sequence) of "
        f"every sync; w = exp(Δ). 'tokens w>2': share truncated by token-level IS at "
        f"{TIS_CAP:g} (verl's rollout_is_threshold); "
        f"'seqs w∉[½,2]': sequences whose weight exp(ΣΔ) a sequence-level mask at 2 drops; "
        f"'seqs geo∉band': exp(mean Δ) outside {list(GEOMETRIC_BAND)} (verl's geometric "
        f"rejection). '{BAND_ROW}': each column's range with geoscale's scales × 2^(k/4) "
        f"(all certified, only E4M3's grid moves): a difference between sources inside it "
        f"is rounding noise, not the source. Percentile: p{100 * PERCENTILE:g} of |k|, |v| per layer × {MARGIN}, "
        f"over the trainer's batch at the synced weights (NeMo-RL); max-abs the same batch's "
        f"max; static min-max: max over 8×64 bytes of text before training. 'saturated': "
        f"cache entries clamped at 448, summed over syncs (syncs with any). 'range used': "
        f"max |x/scale| / 448, median over syncs. 'ms / sync': this machine (shared, "
        f"loaded: ratios within a run only), median over syncs: attention_scales of the "
        f"updated policy, or the calibration forward over the trainer's batch and its "
        f"statistic; the one-time costs before training: geoscale's trace "
        f"{one['trace s']:.2f} s, the static calibration {one['calibration s']:.3f} s. "
        f"'7B GFLOP / sync': {FLOP_SHAPE}, trainer's batch {RL_BATCH[0]}×{RL_BATCH[1]} "
        f"tokens (python -m bench.sync_cost for the formulas). The trainer steps with its "
        f"default optimizer (adamw_torch_fused). No FP8: the engine and the "
        f"trainer run the same kernels here, so its Δ is float reassociation only (an "
        f"engine's own kernels add their floor to every row).")
