"""Scenarios 1-4: the transients where delayed scaling goes stale (paper §5.2, Table 4, App. H).

Every method runs on a fresh copy of the same pretrained weights; geometry and the baselines
all audit (materialize the scores) so that overflows are counted, never inferred.
"""
from __future__ import annotations

import torch

from bench.methods import TRANSIENT_METHODS, wrap_with
from bench.runner import Context, ScenarioResult
from bench.scenarios.common import observe_step, records, scale_attention_weights, train_steps

__all__ = ["first_forward", "resume", "lr_spike", "weight_spike"]


def first_forward(ctx: Context) -> ScenarioResult:
    """1. First forward pass after loading a pretrained checkpoint."""
    result = ScenarioResult("pretrained", "1. First forward after loading a pretrained "
                            "checkpoint (paper Table 4)",
                            paper="delayed overflows in 100% of layers (48/48 … 80/80), max "
                            "scaled logit 5600-9498; geometry 0 layers, max scaled 1.0-196")
    names = [n for n in (*ctx.models, "minilm") if n in ctx.lms]
    bar = ctx.bar(len(names) * len(TRANSIENT_METHODS), "first forward")
    for name in names:
        lm = ctx.lm(name)
        batch = lm.batch(ctx.generator(1), 4, 128, "val")
        for method in TRANSIENT_METHODS:
            wrapped = wrap_with(lm.build(), method, compiler=ctx.compiler)
            with torch.no_grad():
                wrapped(**batch)
            obs = observe_step(wrapped, [0.0] * len(records(wrapped)))
            result.rows.append({"model": lm.name, "method": method,
                                "overflowing layers": f"{obs.overflow_sites}/{len(records(wrapped))}",
                                "max scaled logit": obs.max_scaled, "max |S|": obs.max_abs})
            bar.update(1)
    bar.close()
    return result


def _count(observations) -> dict:
    return {"overflow steps": sum(o.overflow_sites > 0 for o in observations),
            "max scaled logit": max(o.max_scaled for o in observations),
            "non-finite steps": sum(not o.finite for o in observations)}


def resume(ctx: Context) -> ScenarioResult:
    """2. Resume after N training steps from a weights-only checkpoint (no scaling state)."""
    steps = ctx.steps(40, 300)
    result = ScenarioResult("resume", f"2. Resume after {steps} steps with a fresh scaling "
                            "state: overflow steps in the first 10 (paper §5.2)",
                            paper="delayed overflows in 4 (GPT-2 XL), 2 (Llama-2-70B), 1 "
                            "(Mistral-7B, Llama-2-13B) of the first 10 steps; geometry 0",
                            notes=f"The first {steps} steps train in plain FP32 (one shared "
                            "trajectory); each method then resumes from the same weights.")
    lms = ctx.causal_lms()
    bar = ctx.bar(len(lms) * (steps + 10 * len(TRANSIENT_METHODS)), "resume")
    for lm in lms:
        model = lm.build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = ctx.generator(2)
        model.train()
        for _ in range(steps):
            opt.zero_grad()
            lm.loss(model, lm.batch(gen, ctx.pick(4, 8), 128, "train")).backward()
            opt.step()
            bar.update(1)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        for method in TRANSIENT_METHODS:
            fresh = lm.build()
            fresh.load_state_dict(weights)
            wrapped = wrap_with(fresh, method, compiler=ctx.compiler)
            opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
            obs = train_steps(lm, wrapped, fresh, opt, ctx.generator(3), 10,
                              batch=ctx.pick(4, 8), bar=bar)
            result.rows.append({"model": lm.name, "method": method, **_count(obs)})
    bar.close()
    return result


def lr_spike(ctx: Context) -> ScenarioResult:
    """3. A 100× learning-rate spike after a stretch at a low learning rate."""
    before = ctx.steps(20, 100)
    result = ScenarioResult("lr-spike", f"3. 100x learning-rate spike (1e-5 for {before} "
                            "steps, then 1e-3): overflow steps in the next 10",
                            paper="delayed overflows on 3-5 of 10 steps (NaN gradients on "
                            "GPT-2 XL); geometry 0")
    lms = ctx.causal_lms()
    bar = ctx.bar(len(lms) * len(TRANSIENT_METHODS) * (before + 10), "lr spike")
    for lm in lms:
        for method in TRANSIENT_METHODS:
            model = lm.build()
            wrapped = wrap_with(model, method, compiler=ctx.compiler)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            obs = train_steps(lm, wrapped, model, opt, ctx.generator(4), before + 10,
                              lr_at=lambda s: 1e-5 if s < before else 1e-3,
                              batch=ctx.pick(4, 8), bar=bar)
            after = obs[before:]
            result.rows.append({"model": lm.name, "method": method, **_count(after),
                                "loss before": obs[before - 1].loss,
                                "loss after": after[-1].loss})
    bar.close()
    return result


def weight_spike(ctx: Context) -> ScenarioResult:
    """4. All attention weights multiplied by 4 at step 10."""
    steps, at = 20, 10
    result = ScenarioResult("weight-spike", "4. 4x attention-weight spike at step 10: scaled "
                            "logit and scale per step (paper Appendix H)",
                            paper="geometry's scale jumps 5.8 -> 93.8 in the same pass, scaled "
                            "logits stay below 85; delayed scaling exceeds 6500")
    lm = ctx.causal_lms()[0]
    bar = ctx.bar(len(TRANSIENT_METHODS) * steps, "weight spike")
    series = {}
    for method in TRANSIENT_METHODS:
        model = lm.build()
        wrapped = wrap_with(model, method, compiler=ctx.compiler)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def spike(step, wrapped=wrapped, model=model):
            if step == at:
                scale_attention_weights(wrapped, model, 4.0)

        obs = train_steps(lm, wrapped, model, opt, ctx.generator(5), steps, hook=spike,
                          batch=ctx.pick(4, 8), bar=bar)
        series[method] = {"max_scaled": [o.max_scaled for o in obs],
                          "scale": [o.scale for o in obs]}
        result.rows.append({
            "model": lm.name, "method": method,
            # steps 5-9: after delayed scaling's own warm-up transient at step 0
            "max scaled before": max(o.max_scaled for o in obs[at - 5:at]),
            "max scaled at spike": obs[at].max_scaled,
            "overflow at spike": obs[at].overflow_sites > 0,
            "overflow steps after": sum(o.overflow_sites > 0 for o in obs[at:]),
            "scale before": obs[at - 1].scale, "scale at spike": obs[at].scale})
    bar.close()
    result.data["spike"] = {"at": at, "series": series}
    from bench.plots import spike_plot

    result.plots.append(spike_plot(series, at, ctx.out_dir / "weight_spike.png"))
    return result
