"""``python -m bench.refresh_cost``: what ``attention_scales`` costs at every weight sync.

An RL loop refreshes the FP8 q/k/v scales after every optimizer step. This times, on the
same model, one training step (forward + backward + AdamW step + zero_grad, a batch of
``--batch × --seq`` tokens) against one refresh after a weight change (every parameter's
version counter bumped, so the bounds are recomputed from all of them, exactly as after an
optimizer step) and one refresh with nothing changed (the bounds read back). Interleaved
rounds in rotating order (``bench.timing.interleaved``), the median of ``--repeats`` calls
per round, the ratio taken within each round; the table gives the median ratio over rounds
and its range. Goal: refresh ≤ 2% of a step.

On a shared machine use ``--threads 1 --clock cpu`` (the default): the process's own CPU time,
which other processes' load barely moves. ``--clock wall`` with more threads is what a user
sees, on an idle machine only.

    python -m bench.refresh_cost                       # three models, ≈ 2 min on 2 cores
    python -m bench.refresh_cost --models llama --rounds 7 --clock wall --threads 2
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import sys

import torch
from tabulate import tabulate

from bench.timing import interleaved, spread_flag

GOAL = 0.02

#: model -> transformers config class and its keyword arguments (random weights, no hub)
MODELS = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8,
                                  num_key_value_heads=2, intermediate_size=1408)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8,
                                  num_key_value_heads=2, intermediate_size=1408)),
    "gpt2": ("GPT2Config", dict(n_layer=8, n_embd=512, n_head=8, n_positions=512,
                                bos_token_id=0, eos_token_id=0)),
}


def build(name: str, vocab: int) -> torch.nn.Module:
    import transformers

    config_class, kwargs = MODELS[name]
    config = getattr(transformers, config_class)(vocab_size=vocab, attn_implementation="sdpa",
                                                 **kwargs)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def measure(name: str, args) -> dict:
    """One model's timings (seconds per call, per round) and its counts."""
    import geoscale_fx

    model = build(name, args.vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    example = ids[:1, :8]
    params = list(model.parameters())

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def refresh_changed():
        torch.autograd.graph.increment_version(params)   # as after optimizer.step()
        return geoscale_fx.attention_scales(model, example)

    def refresh_unchanged():
        return geoscale_fx.attention_scales(model, example)

    scales = geoscale_fx.attention_scales(model, example)       # the one trace
    timings = interleaved({"step": step, "refresh": refresh_changed,
                           "refresh (unchanged)": refresh_unchanged},
                          base="step", rounds=args.rounds, repeats=args.repeats,
                          clock=args.clock)
    qkv = sum(p.numel() for n, p in model.named_parameters()
              if any(t in n for t in ("q_proj", "k_proj", "v_proj", "c_attn")))
    return {"timings": timings, "params": sum(p.numel() for p in params), "qkv": qkv,
            "layers": len(scales) // 3}


def row(name: str, result: dict) -> list:
    t = result["timings"]
    ratio = t.ratio("refresh")
    return [name, f"{result['params'] / 1e6:.1f}M ({result['qkv'] / 1e6:.1f}M q/k/v)",
            result["layers"], f"{t.median_ms('step'):.1f}", f"{t.median_ms('refresh'):.2f}",
            f"{t.median_ms('refresh (unchanged)'):.3f}",
            f"{100 * ratio.median:.2f}% [{100 * ratio.lo:.2f}, {100 * ratio.hi:.2f}]",
            spread_flag(ratio, GOAL, higher_is_better=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("geoscale_fx").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    rows = [row(name, measure(name, args)) for name in args.models]
    print(f"attention_scales refresh vs one training step (AdamW), batch {args.batch}×"
          f"{args.seq} tokens; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.clock} clock, {os.cpu_count()} CPU(s) {platform.machine()}; median of "
          f"{args.repeats} calls per round, {args.rounds} interleaved rounds; goal ≤ "
          f"{100 * GOAL:.0f}%")
    print(tabulate(rows, headers=["model", "parameters", "layers", "step ms", "refresh ms",
                                  "unchanged ms", "refresh / step [range]", "goal"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
