"""The Hugging Face workflow with one ``apply_`` line: generate, Trainer, save/load, errors.

A tiny Llama from its config (no hub), ``compiler="aot_eager"`` (no Inductor). The Trainer
run that the resume and ``from_pretrained`` tests start from is made once per module.
"""
from __future__ import annotations

import inspect
import io
import json
import logging
import os

import pytest
import torch
from torch._dynamo.utils import counters

import geoscale_fx
from geoscale_fx.api.serialization import STATE_FILE
from tests.hf_models import build_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="needs the [hf] extra: pip install accelerate")
safetensors = pytest.importorskip("safetensors")
pytestmark = pytest.mark.zoo

LOGGER = "geoscale_fx"
SITES = ("model_layers_0_self_attn", "model_layers_1_self_attn")


class Tokens(torch.utils.data.Dataset):
    """Causal-LM rows, plus a string column the model does not take (Trainer drops it)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
                "text": f"row {i}"}


def _args(out, **overrides):
    """Default TrainingArguments except what a CPU test needs."""
    kwargs = dict(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                  save_steps=2, report_to="none", use_cpu=True)
    return transformers.TrainingArguments(**{**kwargs, **overrides})


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.geoscale_state.state_dict().items()}


def _sidecar(directory) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(os.path.join(directory, STATE_FILE))


def _steps(state: dict) -> list[int]:
    return [int(state[f"sites.{s}.steps"]) for s in SITES]


@pytest.fixture(autouse=True)
def _fresh_counters():
    counters.clear()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An apply_'d Llama trained by Trainer: 2 optimizer steps × 2 accumulated micro-batches,
    checkpoint-2 saved at the end. Returns (checkpoint dir, state at the end, counters)."""
    torch._dynamo.reset()
    counters.clear()
    out = tmp_path_factory.mktemp("trainer")
    model = geoscale_fx.apply_(build_hf("llama-sdpa").train(), compiler="aot_eager")
    trainer = transformers.Trainer(model=model, args=_args(out, gradient_accumulation_steps=2),
                                   train_dataset=Tokens())
    result = trainer.train()
    return out / "checkpoint-2", _state(model), dict(counters["geoscale"]), result, model


# --------------------------------------------------------------------------------------
# apply_: in place, generate
# --------------------------------------------------------------------------------------

def test_apply_converts_in_place_and_generate_runs_compiled():
    model = build_hf("llama-sdpa")
    config, cls = model.config, type(model)
    reference = inspect.signature(build_hf("llama-sdpa").forward)
    assert geoscale_fx.apply_(model, compiler="aot_eager") is model
    assert type(model) is cls and model.config is config
    assert inspect.signature(model.forward) == reference
    assert "geoscale_state.sites" not in "".join(model.state_dict())   # no site before a call
    out = model.generate(torch.randint(0, 128, (1, 4)), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 6)
    report = geoscale_fx.report(model)
    # the prefill and the decode step ran through geoscale, one state per site
    assert [row["steps"] for row in report.rows] == [2, 2] and not report.skipped
    # the prefill and the one-query decode step lower to the explicit form (aot_eager does
    # not fuse flex_attention; under Inductor the prefill is fused)
    assert counters["geoscale"]["rewrite_fused"] == 0 and report.eager_calls == 0
    assert counters["geoscale"]["rewrite_explicit"] == 4
    assert {f"geoscale_state.sites.{s}.scale" for s in SITES} <= set(model.state_dict())


# --------------------------------------------------------------------------------------
# Trainer: default arguments, checkpoints, resume warm, bf16, the wrapper form
# --------------------------------------------------------------------------------------

def test_trainer_trains_with_gradient_accumulation_and_checkpoints_the_state(trained):
    checkpoint, state, count, result, _model = trained
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    # every micro-batch ran through geoscale: 2 steps × 2 accumulated
    assert _steps(state) == [4, 4]
    assert count["cold_starts"] == 2 and count["rewrite_explicit"] == 2
    # the state sits beside the weights, equal to the model's at the save, not inside them
    assert {k: v.tolist() for k, v in _sidecar(checkpoint).items()} == \
        {k: v.tolist() for k, v in state.items()}
    with safetensors.safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        weights = list(f.keys())
    assert weights and not any(k.startswith("geoscale_state") for k in weights)


def test_trainer_resumes_warm_under_bf16_autocast(trained, tmp_path):
    """A fresh process's model (other initial weights), one apply_ line, the same Trainer
    call with resume_from_checkpoint: the state comes back as saved, no cold start, the step
    counters go on. bf16=True: accelerate's autocast wrapper must not change the state keys."""
    checkpoint, saved, *_ = trained
    torch._dynamo.reset()
    counters.clear()
    model = geoscale_fx.apply_(build_hf("llama-sdpa", seed=1).train(), compiler="aot_eager")
    seen = {}

    class Peek(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            pending = model.geoscale_state.sites.pending   # sites appear at the first call
            seen.update({f"sites.{s}.{n}": t.clone() for s, d in pending.items()
                         for n, t in d.items()})

    args = _args(tmp_path, max_steps=3, gradient_accumulation_steps=2, bf16=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[Peek()])
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert {k: v.tolist() for k, v in seen.items()} == {k: v.tolist() for k, v in saved.items()}
    assert counters["geoscale"]["cold_starts"] == 0
    assert counters["geoscale"]["rewrite_explicit"] == 2
    assert _steps(_state(model)) == [6, 6]                      # 4 before the save, 2 after
    assert geoscale_fx.report(model).eager_calls == 0


def test_trainer_with_the_wrapper_keeps_the_dataset_columns(tmp_path):
    """``wrap(model)`` with default remove_unused_columns: the wrapper's forward has the
    model's signature (it had ``*args, **kwargs``: Trainer dropped every column)."""
    model = build_hf("llama-sdpa").train()
    wrapped = geoscale_fx.wrap(model, compiler="aot_eager")
    assert inspect.signature(wrapped.forward) == inspect.signature(model.forward)
    trainer = transformers.Trainer(model=wrapped, args=_args(tmp_path, max_steps=1),
                                   train_dataset=Tokens())
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert [r["steps"] for r in geoscale_fx.report(wrapped).rows] == [1, 1]


def test_accelerate_rejects_geoscale_as_torch_compile_backend(tmp_path):
    """docs/huggingface.md says apply_ is the route into Trainer because of this error; and
    that ``torch_compile=True`` with a backend accelerate lists leaves a converted model's
    calls to geoscale (accelerate's ``torch.compile`` stops at them): every step scaled."""
    args = _args(tmp_path, torch_compile_backend="geoscale")
    with pytest.raises(ValueError, match="'GEOSCALE' is not a valid DynamoBackend"):
        transformers.Trainer(model=build_hf("llama-sdpa"), args=args, train_dataset=Tokens())
    model = geoscale_fx.apply_(build_hf("llama-sdpa").train(), compiler="eager")
    args = _args(tmp_path, torch_compile=True, torch_compile_backend="eager",
                 save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    call = model._compiled_call_impl
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"     # accelerate's compile
    assert (call.calls, call.eager_calls) == (2, 0)
    assert [r["steps"] for r in geoscale_fx.report(model).rows] == [2, 2]


# --------------------------------------------------------------------------------------
# save_pretrained / from_pretrained
# --------------------------------------------------------------------------------------

def _transformers_warnings(load) -> str:
    """What transformers logs at WARNING and above while ``load()`` runs."""
    handler = logging.StreamHandler(buffer := io.StringIO())
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        load()
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
    return buffer.getvalue()


def test_from_pretrained_then_apply_restores_the_state_warm(trained):
    checkpoint, saved, *_ = trained
    torch._dynamo.reset()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint))
    geoscale_fx.apply_(model, compiler="aot_eager")             # the documented one-liner
    pending = model.geoscale_state.sites.pending                # sites appear at the first call
    assert {f"sites.{s}.{n}": t.tolist() for s, d in pending.items() for n, t in d.items()} \
        == {k: v.tolist() for k, v in saved.items()}
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 8)))
    assert counters["geoscale"]["cold_starts"] == 0 and not pending
    assert _steps(_state(model)) == [5, 5]                      # 4 saved + this call


def test_plain_from_pretrained_sees_only_the_model_keys(trained, tmp_path):
    """No geoscale installed on the reading side: no unexpected keys, no warnings."""
    checkpoint, *_ = trained
    logs = _transformers_warnings(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint)))
    assert logs == ""
    # the capture works: the same model with one stray key in its weights is reported
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint))
    model.register_buffer("geoscale_stray", torch.ones(1))
    model.save_pretrained(tmp_path)
    logs = _transformers_warnings(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)))
    assert "geoscale_stray" in logs and "UNEXPECTED" in logs


def test_save_pretrained_of_a_converted_model_writes_the_state_beside(trained, tmp_path):
    *_, model = trained
    model.save_pretrained(tmp_path)
    assert sorted(_sidecar(tmp_path)) == sorted(model.geoscale_state.state_dict())
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("geoscale_state") for k in f.keys())
    assert "geoscale_state.sites.model_layers_0_self_attn.scale" in model.state_dict()


def test_a_state_saved_with_other_weights_is_ignored(trained, caplog):
    """A stale geoscale_state.safetensors (the weights were re-saved without it) would scale
    with another σ: it is refused, loudly, and the sites start cold."""
    checkpoint, *_ = trained
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint))
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        geoscale_fx.apply_(model, compiler="aot_eager")
    assert len(model.geoscale_state.sites.pending) == 0
    message, = [r.getMessage() for r in caplog.records if STATE_FILE in r.getMessage()]
    assert "layers.1.self_attn.k_proj.weight" in message and "cold" in message
    meta = json.loads(safetensors.safe_open(str(checkpoint / STATE_FILE), "pt")
                      .metadata()["weights"])
    assert "model.layers.1.self_attn.k_proj.weight" in meta
    assert geoscale_fx.load_state(build_hf("llama-sdpa", seed=3), str(checkpoint)) is False


# --------------------------------------------------------------------------------------
# errors users will hit
# --------------------------------------------------------------------------------------

def test_apply_refuses_a_compiled_model():
    model = build_hf("llama-sdpa")
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is already compiled by "
                                         r"torch.compile.*_orig_mod"):
        geoscale_fx.apply_(torch.compile(model))
    model.compile()
    with pytest.raises(ValueError, match=r"LlamaForCausalLM was already compiled with "
                                         r"LlamaForCausalLM.compile\(\)"):
        geoscale_fx.apply_(model)


def test_apply_twice_is_idempotent_with_the_same_options_else_an_error(caplog):
    model = geoscale_fx.apply_(build_hf("llama-sdpa"), compiler="aot_eager", alpha="theory")
    call = model._compiled_call_impl
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert geoscale_fx.apply_(model, compiler="aot_eager", alpha="theory") is model
    assert model._compiled_call_impl is call
    assert any("apply_(LlamaForCausalLM) again" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is converted already.*"
                                         r"alpha=1.0 \(converted with 'theory'\)"):
        geoscale_fx.apply_(model, compiler="aot_eager")


def test_apply_and_wrap_exclude_each_other():
    model = build_hf("llama-sdpa")
    geoscale_fx.wrap(model, compiler="aot_eager")
    with pytest.raises(ValueError, match="LlamaForCausalLM is wrapped by geoscale_fx.wrap"):
        geoscale_fx.apply_(model)
    converted = geoscale_fx.apply_(build_hf("llama-sdpa"), compiler="aot_eager")
    with pytest.raises(ValueError, match="LlamaForCausalLM was already converted in place"):
        geoscale_fx.wrap(converted)


def test_a_model_without_attention_is_warned_about_after_its_first_call(caplog):
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    geoscale_fx.apply_(mlp, compiler="aot_eager")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mlp(torch.randn(2, 8))
        mlp(torch.randn(2, 8))
    warnings = [r.getMessage() for r in caplog.records if "no attention site" in r.getMessage()]
    assert len(warnings) == 1 and "Sequential" in warnings[0]
    assert geoscale_fx.report(mlp).eager_calls == 0           # it ran compiled, not eagerly


def test_peft_prefix_tuning_is_refused_naming_the_model():
    """Prefix tuning's learned keys enter each attention as a KV cache: every site would be
    left as is (measured: "cat with `_`, which does not come from the projection")."""
    peft = pytest.importorskip("peft", reason="needs the [hf] extra: pip install peft")
    model = peft.get_peft_model(build_hf("llama-sdpa"), peft.PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="PeftModelForCausalLM uses PEFT prefix tuning"):
        geoscale_fx.apply_(model, compiler="aot_eager")
    assert model._compiled_call_impl is None and not hasattr(model, "geoscale_state")
