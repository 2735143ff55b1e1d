"""Scenario 14: RL rollouts with an FP8 KV cache, and what each source of k/v scales costs.

TRL's ``GRPOTrainer`` trains a pretrained zoo LM (byte level) converted with
``geoscale_fx.apply_(model, kv_cache="fp8")``; its rollouts sample through ``generate`` with
geoscale's FP8 cache. At every rollout the policy's weights are synced into a plain copy of
the model (the serving engine, as an RL loop syncs its engine), with the k/v scales that
``geoscale_fx.attention_scales(policy)`` gives under the policy's own names (per tensor, as
engines load ``k_scale``/``v_scale``). On the tokens the rollout sampled, the engine's decode
steps through an FP8 cache (teacher forced, one token per step) give log-probabilities that
are compared with the trainer's: the engine's unquantized forward on the same tokens, no
cache (what the policy loss differentiates). Per completion token: mean ``|Δ log p|`` of the
sampled token and ``KL(trainer ‖ rollout)``, for four sources of the cache's scales:

* geoscale — ``attention_scales`` of the current weights at every sync;
* frozen at step 0 — the same scales taken once before training (a checkpoint's static
  scales, never refreshed at weight syncs);
* calibrated at step 0 — ``amax / R_max`` per layer over a calibration batch before
  training (a min-max observer, as llm-compressor's static KV scales), never refreshed;
* unit (1.0) — vLLM's default when a checkpoint has none;
* no FP8 — the unquantized cache (the floor: float reassociation only).

Each source has its own cache and saturation counters (entries clamped at ``R_max``), and
sees the same tokens at the same weights. Per step also: the largest relative change of a
key or value projection since step 0. ``python -m bench --only rl`` (``--full``: 30 steps).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import geoscale_fx
from bench.quality import spread
from bench.runner import Context, ScenarioResult
from bench.scenarios.kv_cache import FMT, _cache, _layer_scales, _teacher_forced
from geoscale_fx.compile.attach import geoscale_call
from geoscale_fx.core.bounds import fp8_max
from geoscale_fx.kv_cache.manager import cache_argument
from geoscale_fx.kv_cache.layer_scales import LayerScales

__all__ = ["rl_rollouts", "SOURCES", "mismatch", "engine_layer_scales"]

log = logging.getLogger("bench")

SOURCES = ("geoscale", "frozen at step 0", "calibrated at step 0", "unit (1.0)", "no FP8")
#: bytes per prompt and per completion; prompts and completions per step
PROMPT_LEN, COMPLETION_LEN, PROMPTS, GENERATIONS = 24, 24, 2, 4


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


def mismatch(trainer_logits: torch.Tensor, rollout_logits: torch.Tensor,
             tokens: torch.Tensor) -> tuple[float, float]:
    """``(mean |Δ log p| of the sampled tokens, mean KL(trainer ‖ rollout))`` per token;
    logits ``(steps, B, V)`` predicting ``tokens`` ``(B, steps)``."""
    log_t = F.log_softmax(trainer_logits.double(), dim=-1)
    log_r = F.log_softmax(rollout_logits.double(), dim=-1)
    index = tokens.t().unsqueeze(-1)                                   # (steps, B, 1)
    delta = (log_t.gather(-1, index) - log_r.gather(-1, index)).abs()
    kl = (log_t.exp() * (log_t - log_r)).sum(-1)
    return float(delta.mean()), float(kl.mean())


def engine_layer_scales(engine, scales: dict[str, torch.Tensor]) -> list[LayerScales]:
    """The engine's cache layers with the named ``{path.k_scale, path.v_scale}`` scales,
    each attention module found by its path in the engine (its ``layer_idx``): a name the
    engine does not have is an error here, as a dropped scale is in an engine."""
    layers = {}
    for name, value in scales.items():
        path, _, kind = name.rpartition(".")
        if kind not in ("k_scale", "v_scale"):
            continue
        layer = engine.get_submodule(path).layer_idx      # AttributeError: a foreign name
        layers.setdefault(layer, {})[kind] = value.reshape(-1)[:1].float()
    ordered = [layers[i] for i in range(len(layers))]
    return _layer_scales([s["k_scale"] for s in ordered], [s["v_scale"] for s in ordered])


def _unit(n_layers: int) -> list[LayerScales]:
    return _layer_scales([torch.ones(1)] * n_layers, [torch.ones(1)] * n_layers)


def _projection_change(engine, start: dict) -> float:
    """Largest ``‖W − W₀‖ / ‖W₀‖`` over the key and value projections."""
    return max(float((p.detach() - start[n]).norm() / start[n].norm())
               for n, p in engine.named_parameters() if n in start)


class _Rollouts:
    """Records the sequences the policy's ``generate`` returns (TRL's rollouts)."""

    def __init__(self, model):
        self.sequences: list[torch.Tensor] = []
        generate = model.generate

        def recorded(*args, **kwargs):
            out = generate(*args, **kwargs)
            self.sequences.append(out if isinstance(out, torch.Tensor) else out.sequences)
            return out

        model.generate = recorded


def _calibrated(engine, ids: torch.Tensor) -> list[LayerScales]:
    """``amax / R_max`` of each layer's keys and values over ``ids`` (min-max observer)."""
    cache = DynamicCache(config=engine.config)
    with torch.no_grad():
        engine(ids, use_cache=True, **{cache_argument(): cache})
    limit = fp8_max(FMT)
    return _layer_scales([c.keys.abs().amax().reshape(1) / limit for c in cache.layers],
                         [c.values.abs().amax().reshape(1) / limit for c in cache.layers])


def _measure(engine, policy, sequences: torch.Tensor, static: tuple, probe_ids) -> dict:
    """One rollout: every source's mismatch and saturations on the sampled tokens."""
    engine.load_state_dict(geoscale_fx.plain_state_dict(policy))
    fresh = engine_layer_scales(engine, geoscale_fx.attention_scales(policy, probe_ids))
    tokens = sequences[:, :PROMPT_LEN + COMPLETION_LEN]
    with torch.no_grad():
        trainer = engine(tokens).logits[:, PROMPT_LEN - 1:-1].transpose(0, 1).float()
    found = {}
    for source, layer_scales in zip(SOURCES, (fresh, *static, _unit(len(fresh)), None)):
        cache, counters = _cache(engine, layer_scales) if layer_scales is not None else \
            (None, None)
        rollout = _teacher_forced(engine, tokens, PROMPT_LEN, cache)
        delta, kl = mismatch(trainer, rollout, tokens[:, PROMPT_LEN:])
        found[source] = {"dlogp": delta, "kl": kl, "saturated": 0 if counters is None else
                         int(sum(int(c.sum()) for c in counters))}
    return found


def rl_rollouts(ctx: Context) -> ScenarioResult:
    """14. RL rollouts with an FP8 KV cache: rollout–trainer mismatch per scale source."""
    import transformers
    import trl

    result = ScenarioResult("rl", "14. RL rollouts with an FP8 KV cache: rollout-trainer "
                                  "mismatch per source of k/v scales")
    lm = ctx.lm(ctx.models[0])       # one LM (causal_lms() builds every one in --full)
    steps = ctx.steps(8, 30)
    lr = 5e-4
    policy, engine = lm.build(), lm.build()
    geoscale_fx.apply_(policy, kv_cache="fp8", compiler=ctx.compiler)
    probe_ids = torch.arange(1, 9).reshape(1, 8)
    static = (engine_layer_scales(engine, geoscale_fx.attention_scales(policy, probe_ids)),
              _calibrated(engine, lm.batch(ctx.generator(15), 8, 64, "val")["input_ids"]))
    start = {n: p.detach().clone() for n, p in engine.named_parameters()
             if any(t in n for t in ("k_proj", "v_proj", "c_attn"))}
    rollouts = _Rollouts(policy)
    per_step: list[dict] = []

    class Measure(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            found = _measure(engine, policy, rollouts.sequences[-1], static, probe_ids)
            per_step.append({"step": state.global_step,
                             "k/v projection change": _projection_change(engine, start),
                             **{s: v for s, v in found.items()}})
            bar.update(1)

    config = trl.GRPOConfig(
        output_dir=str(ctx.out_dir / "rl"), per_device_train_batch_size=PROMPTS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=COMPLETION_LEN, max_steps=steps,
        generation_kwargs={"min_new_tokens": COMPLETION_LEN},    # full-length completions
        learning_rate=lr, lr_scheduler_type="constant", report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=steps,
        gradient_checkpointing=False, seed=ctx.seed, disable_tqdm=True)
    bar = ctx.bar(steps, f"rl {lm.name}")
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=_reward, args=config,
                              train_dataset=_prompts(lm, ctx, 64), processing_class=_tokenizer(),
                              callbacks=[Measure()])
    trainer.train()
    bar.close()
    call = geoscale_call(policy)
    for source in SOURCES:
        result.rows.append({
            "model": lm.name, "source": source,
            "mean |Δ log p| / token": spread([s[source]["dlogp"] for s in per_step]),
            "KL / token": spread([s[source]["kl"] for s in per_step]),
            "saturated entries": sum(s[source]["saturated"] for s in per_step),
            "steps saturating": sum(1 for s in per_step if s[source]["saturated"])})
    result.data = {"per_step": per_step, "lr": lr}
    result.notes = (
        f"{steps} GRPO steps (TRL {trl.__version__}), lr {lr}, {PROMPTS}×{GENERATIONS} "
        f"completions of {COMPLETION_LEN} bytes per step; k/v projections moved "
        f"{per_step[-1]['k/v projection change']:.3g} (relative) by the last step. Policy "
        f"through geoscale: {call.eager_calls} eager calls, {call.compiling_calls} compiling "
        f"calls ({call.compile_seconds:.0f} s). Mismatch: median [min–max] over steps.")
    from bench.plots import rl_plot

    result.plots.append(rl_plot(per_step, SOURCES, ctx.out_dir / "rl_rollouts.png"))
    return result
