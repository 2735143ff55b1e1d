"""An emulated NVFP4 KV cache: which global scale s_g, and what it costs in logits.

NVFP4 stores E2M1 values with an E4M3 scale per 16 entries of the head dim; the block scale is
amax_b / 6 / s_g, so s_g decides whether block scales stay in E4M3's normal range
[2^-6, 448]: too small and they overflow (entries clipped), too large and they go subnormal
(fewer bits, or 0). For each model this compares, per kv head and per k/v, s_g from

* ``certified bound``      B / (6 · 448), B the certified bound of ``WeightKVScales`` (ours:
                           from the weights, no data; no block scale can overflow);
* ``observed amax``        the amax of the very keys/values evaluated / (6 · 448) (an oracle);
* ``calibrated amax``      the amax of another batch / (6 · 448) (what engines calibrate);
* ``constant 1.0``         no scale at all;

and, for reference, the FP8 E4M3 cache with certified per-head scales. Teacher-forced: one
forward over each sequence whose attention reads every key/value through the cache (an
NVFP4 block lies along one token's head dim, so this equals step-by-step decoding). Logit
error against the unquantized model with ``bench.quality.logit_metrics`` (relative L2, KL per
token, top-1 agreement); block scales outside E4M3's normal range in % of the unquantized
model's key (k) and value (v) blocks (an all-zero block counts as neither).

Models: the quick pretrained byte-level GPT-2 of ``bench.lms`` if its checkpoint is cached
(never trained here), random-weight Llama (GQA) and GPT-2 built from configs, and the same
Llama with its key and value projections ×0.01 (a stress case: entries ~100× smaller). Run
``python -m bench.nvfp4_kv`` (about half a minute on 2 cores).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from typing import Callable, Optional

import torch
from tabulate import tabulate

from bench.quality import logit_metrics
from geoscale_fx.core import nvfp4
from geoscale_fx.kv_cache.layers import fp8_cache
from geoscale_fx.kv_cache.layer_scales import LayerScales
from geoscale_fx.kv_cache.weight_scales import WeightKVScales

log = logging.getLogger("geoscale_fx.bench")

CHOICES = ("certified bound", "observed amax", "calibrated amax", "constant 1.0")


@dataclasses.dataclass
class Workload:
    name: str
    model: torch.nn.Module
    batch: Callable[[int, int, int], torch.Tensor]        # (seed, batch, seq) -> ids (B, T)


def _random_models(vocab: int = 256) -> list[Workload]:
    import transformers

    def ids(seed, batch, seq):
        return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))

    torch.manual_seed(0)
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=256,
                                     vocab_size=vocab, max_position_embeddings=256,
                                     attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=vocab,
                                   n_positions=256, attn_implementation="sdpa",
                                   bos_token_id=0, eos_token_id=0)
    works = [Workload(f"random-{c.model_type}", transformers.AutoModelForCausalLM.from_config(c)
                      .eval(), ids) for c in (llama, gpt2)]
    torch.manual_seed(0)
    small = transformers.AutoModelForCausalLM.from_config(llama).eval()
    with torch.no_grad():       # keys/values ~100× smaller: where a fixed s_g goes subnormal
        for layer in small.model.layers:
            layer.self_attn.k_proj.weight.mul_(0.01)
            layer.self_attn.v_proj.weight.mul_(0.01)
    return works + [Workload("random-llama, W_k/W_v ×0.01", small, ids)]


def _pretrained_gpt2() -> Optional[Workload]:
    """The quick pretrained GPT-2 of ``bench.lms`` if cached, with stdlib byte windows."""
    from bench import lms
    from models_zoo import corpus, pretrain

    recipe = pretrain.DEFAULT_RECIPES["gpt2"]
    recipe = dataclasses.replace(recipe, steps=lms.QUICK_PRETRAIN_STEPS,   # as lms does
                                 batch_size=lms.QUICK_PRETRAIN_BATCH,
                                 warmup_steps=min(recipe.warmup_steps, 15))
    data = corpus.load_stdlib_corpus(recipe.data_budget_bytes, recipe.val_every)
    if not (pretrain.checkpoint_dir(recipe, data.sha256) / "metrics.json").is_file():
        log.warning("no cached quick pretrained gpt2 (bench.lms.pretrained_lm('gpt2') trains "
                    "one, minutes of CPU): left out")
        return None
    lm = lms.pretrained_lm("gpt2", "quick")

    def ids(seed, batch, seq):
        split = "val" if seed == 0 else "train"       # calibrate on other text than evaluated
        return lm.batch(torch.Generator().manual_seed(seed), batch, seq, split)["input_ids"]

    return Workload(lm.name, lm.build(), ids)


def _forward(model, ids: torch.Tensor, cache):
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits       # (B, T, V)


def _plain(model, ids: torch.Tensor):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    return _forward(model, ids, cache), cache


def _amax(cache, per_tensor: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (k, v) amax per kv head (or per tensor), float64."""
    def reduce(t):
        amax = t.abs().amax(dim=(0, 2, 3)).double()                          # (H,)
        return amax.amax().reshape(1) if per_tensor else amax
    return [(reduce(layer.keys), reduce(layer.values)) for layer in cache.layers]


def _globals(choice: str, bounds, observed, calibrated) -> list[tuple[torch.Tensor, ...]]:
    if choice == "constant 1.0":
        return [(torch.ones(1), torch.ones(1)) for _ in bounds]
    source = {"certified bound": bounds, "observed amax": observed,
              "calibrated amax": calibrated}[choice]
    return [(nvfp4.global_scale(k), nvfp4.global_scale(v)) for k, v in source]


def _nvfp4_cache(model, scales: list[tuple[torch.Tensor, torch.Tensor]]):
    layers = [LayerScales(i, "", torch.ones(1), k, v) for i, (k, v) in enumerate(scales)]
    counters = [torch.zeros(2, dtype=torch.int64) for _ in layers]
    cache = fp8_cache(model.config, layers, nvfp4.NVFP4, counters)
    for layer, (k_g, v_g), counter in zip(cache.layers, scales, counters):
        layer.setup_fp8(k_g, v_g, nvfp4.NVFP4, counter)       # exactly these global scales
    return cache


def _range_percent(states: list[torch.Tensor], scales: list[torch.Tensor]) -> tuple[float, ...]:
    """% of blocks whose scale overflows / is subnormal, over every layer."""
    counts, blocks = torch.zeros(2, dtype=torch.int64), 0
    for t, s_g in zip(states, scales):
        ratio = nvfp4.block_scale_ratio(t, s_g.view(1, -1, 1, 1))
        counts += nvfp4.scale_range_counts(ratio)
        blocks += ratio.numel()
    return tuple(100.0 * float(c) / blocks for c in counts)


def measure(work: Workload, batch: int, seq_len: int, per_tensor: bool) -> list[dict]:
    model = work.model
    ids, calibration = work.batch(0, batch, seq_len), work.batch(1, 2, seq_len)
    ref, plain = _plain(model, ids)
    layers = WeightKVScales(model).capture(ids[:1, :8]).layers()
    bounds = [(s.k_bound, s.v_bound) for s in layers]
    if per_tensor:
        bounds = [(k.amax().reshape(1), v.amax().reshape(1)) for k, v in bounds]
    observed = _amax(plain, per_tensor)
    calibrated = _amax(_plain(model, calibration)[1], per_tensor)
    keys = [layer.keys for layer in plain.layers]
    values = [layer.values for layer in plain.layers]
    rows = []
    for choice in CHOICES:
        scales = _globals(choice, bounds, observed, calibrated)
        metrics = logit_metrics(ref, _forward(model, ids, _nvfp4_cache(model, scales)))
        k_over, k_sub = _range_percent(keys, [k for k, _ in scales])
        v_over, v_sub = _range_percent(values, [v for _, v in scales])
        ratio = torch.cat([torch.cat([k.double() / nvfp4.global_scale(ok).double(),
                                      v.double() / nvfp4.global_scale(ov).double()])
                           for (k, v), (ok, ov) in zip(scales, observed)])
        rows.append({"model": work.name, "kv cache": "nvfp4", "global scale": choice,
                     "s_g / observed (geo-mean)": float(ratio.log().mean().exp()),
                     "rel L2": metrics["rel_l2"], "KL/token": metrics["kl"],
                     "top-1": metrics["top1"], "k over %": k_over, "k subnormal %": k_sub,
                     "v over %": v_over, "v subnormal %": v_sub})
    fp8_layers = [LayerScales(i, "", torch.ones(1), k, v) for i, (k, v) in enumerate(bounds)]
    fp8 = fp8_cache(model.config, fp8_layers, "e4m3",
                    [torch.zeros(2, dtype=torch.int64) for _ in fp8_layers])
    metrics = logit_metrics(ref, _forward(model, ids, fp8))
    rows.append({"model": work.name, "kv cache": "fp8 e4m3", "global scale": "certified bound",
                 "rel L2": metrics["rel_l2"], "KL/token": metrics["kl"],
                 "top-1": metrics["top1"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nvfp4_kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--per-tensor", action="store_true",
                        help="one global scale per layer and k/v (max over kv heads)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    start = time.perf_counter()
    workloads = [w for w in (_pretrained_gpt2(), *_random_models()) if w is not None]
    rows = []
    for work in workloads:
        rows += measure(work, args.batch, args.seq_len, args.per_tensor)
        log.info("%s measured (%.1f s so far)", work.name, time.perf_counter() - start)
    print(tabulate(rows, headers="keys", floatfmt=".4g", missingval="—"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
