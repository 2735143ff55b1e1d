"""TRL's GRPO trainer, converted with geoscale or compiled plainly: calls without a compiled
graph, compiles and their seconds, in the same run.

    python -m bench.trl_grpo                      # 20 steps, gradient checkpointing on and off
    python -m bench.trl_grpo --steps 30 --compiler inductor

A tiny Llama (2 layers, d = 64) trained by ``trl.GRPOTrainer`` (rollouts with ``generate``,
4 completions of 8 tokens per prompt, the policy loss with grad, a reference model) for
``--steps`` steps, with its forward (the rollouts' prefill and decode steps included):

* geoscale — ``geoscale_fx.apply_(model, kv_cache="fp8")``;
* plain — ``model.compile(backend=...)`` with the same compiler, Dynamo's defaults.

Per program: the model's calls, those that ran no compiled graph (eagerly: without FP8 for
geoscale), the calls that compiled something, the graphs compiled, those calls' seconds
(tracing and compiling included) and the training's seconds. TRL's default turns gradient
checkpointing on, and transformers 5.24 adds a forward hook to the input embeddings at every
gradient-checkpointing enable without removing it at disable (TRL toggles it around each
generation): each added hook changes Dynamo's guards, so both programs recompile every step;
the runs without gradient checkpointing show the loop's own states.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

__all__ = ["run_program", "main"]


def _tokenizer():
    import tokenizers
    import transformers

    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab.update({"<eos>": len(vocab), "<pad>": len(vocab) + 1})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                pad_token="<pad>")


def _checkpoint(directory: Path):
    import transformers

    tok = _tokenizer()
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=len(tok), max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return tok


class _PlainCounter:
    """``model.compile(backend=...)`` with its graphs' calls counted."""

    def __init__(self, model, compiler: str):
        from torch._dynamo.backends.debugging import aot_eager

        self.graph_calls = self.compiles = 0

        def backend(gm, example_inputs):
            self.compiles += 1
            if compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx

                compiled = compile_fx(gm, example_inputs)
            else:
                compiled = aot_eager(gm, example_inputs)

            def run(*args):
                self.graph_calls += 1
                return compiled(*args)

            return run

        model.compile(backend=backend)
        inner = model._compiled_call_impl
        self.calls = self.eager_calls = self.compiling_calls = 0
        self.compile_seconds = 0.0

        def call(*args, **kwargs):
            calls, compiles, start = self.graph_calls, self.compiles, time.perf_counter()
            out = inner(*args, **kwargs)
            self.calls += 1
            self.eager_calls += self.graph_calls == calls
            if self.compiles != compiles:
                self.compiling_calls += 1
                self.compile_seconds += time.perf_counter() - start
            return out

        model._compiled_call_impl = call


def run_program(program: str, steps: int, gradient_checkpointing: bool, compiler: str,
                directory: Path, tok) -> dict:
    import datasets
    import transformers
    import trl

    import geoscale_fx
    from geoscale_fx.compile.attach import geoscale_call

    torch._dynamo.reset()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    if program == "geoscale":
        geoscale_fx.apply_(model, kv_cache="fp8", compiler=compiler)
        call = geoscale_call(model)
    else:
        call = _PlainCounter(model, compiler)
    data = datasets.Dataset.from_dict({"prompt": ["abc" * (i % 4 + 1) for i in range(64)]})
    args = trl.GRPOConfig(
        output_dir=str(directory / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=steps, learning_rate=1e-3, report_to=[],
        use_cpu=True, save_strategy="no", beta=0.04, logging_steps=steps, disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [
        float(c.count("a")) for c in completions], args=args, train_dataset=data,
        processing_class=tok)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    return {"program": program, "gradient checkpointing": gradient_checkpointing,
            "calls": call.calls,
            "eager calls": call.eager_calls, "compiling calls": call.compiling_calls,
            "graphs compiled": call.backend.compiles if program == "geoscale" else
            call.compiles, "compile s": call.compile_seconds, "train s": seconds,
            "region renewals": call.region.renewals if program == "geoscale" else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trl_grpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compiler", choices=["aot_eager", "inductor"], default="aot_eager")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        tok = _checkpoint(directory)
        for gradient_checkpointing in (True, False):
            for program in ("geoscale", "plain"):
                rows.append(run_program(program, args.steps, gradient_checkpointing,
                                        args.compiler, directory, tok))
                print(tabulate([rows[-1]], headers="keys", floatfmt=".1f"), flush=True)
    print(f"\n{args.steps} GRPO steps, compiler {args.compiler}")
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
