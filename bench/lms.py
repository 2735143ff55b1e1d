"""Models the scenarios run on, with real text to feed them.

A ``BenchLM`` builds fresh copies of a model with its pretrained weights ("loading a
checkpoint"), and gives batches of real text: the CPython standard library sources (byte
level) for the causal LMs trained by ``models_zoo.pretrain``, English sentences for MiniLM.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["BenchLM", "pretrained_lm", "quick_recipe", "with_named_loss", "minilm_lm",
           "large_key_lm", "scale_keys", "key_value_parameters", "projection_snapshot",
           "projection_drift", "QUICK_PRETRAIN_STEPS"]

#: the quick profile trains its byte-level LMs for fewer, smaller steps (a separate cache
#: entry): about a minute each on 2 cores, so a first run stays within ten minutes
QUICK_PRETRAIN_STEPS = 150
QUICK_PRETRAIN_BATCH = 16


@dataclass
class BenchLM:
    name: str
    build: Callable[[], nn.Module]           # a fresh model with the pretrained weights
    batch: Callable[[torch.Generator, int, int, str], dict]   # (gen, batch, seq, split)
    causal: bool = True
    info: dict = dataclasses.field(default_factory=dict)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        out = model(**batch)
        return out.loss if hasattr(out, "loss") else out[1]

    def train_step(self, model: nn.Module, compiled: nn.Module, batch: dict,
                   lr: float) -> Callable[[], None]:
        """One AdamW step of ``model`` (in training mode) through ``compiled`` on ``batch``,
        as a function: what the timed training steps call."""
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)

        def step():
            opt.zero_grad(set_to_none=True)
            self.loss(compiled, batch).backward()
            opt.step()
        return step


@functools.lru_cache(maxsize=2)
def _corpus(budget: int = 4_000_000):
    from models_zoo import corpus

    return corpus.load_stdlib_corpus(budget)


def _byte_batch(data: torch.Tensor, gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + seq] for s in start.tolist()]).long()      # (B, T)


def quick_recipe(family: str):
    """The quick profile's pretraining recipe for ``family`` (its checkpoints are shipped in
    ``models_zoo/checkpoints``)."""
    from models_zoo import pretrain

    recipe = pretrain.DEFAULT_RECIPES[family]
    return dataclasses.replace(recipe, steps=QUICK_PRETRAIN_STEPS, batch_size=QUICK_PRETRAIN_BATCH,
                               warmup_steps=min(recipe.warmup_steps, 15))


def with_named_loss(model: nn.Module) -> nn.Module:
    """``model`` with its causal-LM loss named where transformers finds none: transformers 5
    finds no loss type in the name GPT2LMHeadModel and logs ``warning_once`` at every loss, a
    graph break (Dynamo re-traces the forward) in every compiled training step; the loss it
    falls back to, named."""
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def pretrained_lm(family: str, profile: str = "quick") -> BenchLM:
    """A byte-level GPT-2- or Llama-style LM trained on the stdlib sources (cached)."""
    from models_zoo import pretrain

    recipe = quick_recipe(family) if profile == "quick" else pretrain.DEFAULT_RECIPES[family]
    model, metrics = pretrain.load_pretrained(family, recipe)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config, cls = model.config, type(model)

    def build() -> nn.Module:
        fresh = cls(config)
        fresh.load_state_dict(state)
        return with_named_loss(fresh).eval()

    def batch(gen, size, seq, split="train"):
        data = _corpus().train if split == "train" else _corpus().val
        ids = _byte_batch(data, gen, size, seq)
        return {"input_ids": ids, "labels": ids}

    return BenchLM(f"pretrained-{family}", build, batch,
                   info={"val_loss": metrics.get("val_loss"), "steps": metrics.get("steps")})


def _attentions(model: nn.Module) -> list[nn.Module]:
    """The attention modules with a key projection (``k_proj``, or GPT-2's fused
    ``c_attn``) and a softmax scale (``scaling``), in order."""
    found = [m for m in model.modules() if hasattr(m, "scaling")
             and (hasattr(m, "k_proj") or hasattr(m, "c_attn"))]
    if not found:
        raise ValueError(f"no attention with a key projection and a 'scaling' in "
                         f"{type(model).__name__}")
    return found


def key_value_parameters(attn: nn.Module) -> dict[str, list[torch.Tensor]]:
    """``{"k": [weight, bias], "v": [...]}`` of one attention: its ``k_proj``/``v_proj``, or
    views of the key and value columns of GPT-2's fused ``c_attn`` (Conv1D ``(d, 3d)``:
    columns ``[q | k | v]``); a missing bias is left out."""
    if hasattr(attn, "k_proj"):
        parts = {"k": attn.k_proj, "v": attn.v_proj}
        return {r: [t for t in (m.weight, m.bias) if t is not None] for r, m in parts.items()}
    d, c_attn = attn.split_size, attn.c_attn
    return {r: [t for t in (c_attn.weight[:, i * d:(i + 1) * d],
                            None if c_attn.bias is None else c_attn.bias[i * d:(i + 1) * d])
                if t is not None] for r, i in (("k", 1), ("v", 2))}


def scale_keys(model: nn.Module, factor: float) -> nn.Module:
    """Keys ``× factor`` with the same logits: every attention's key projection (weight and
    bias: ``k_proj``, or the key columns of GPT-2's fused ``c_attn``) times ``factor`` and
    its softmax scale (the module's ``scaling``) divided by it. With a power of two the
    logits are the same floats, bit for bit. In place; returns ``model``."""
    try:
        attentions = _attentions(model)
    except ValueError as exc:
        raise ValueError(f"scale_keys: {exc}") from None
    with torch.no_grad():
        for attn in attentions:
            for p in key_value_parameters(attn)["k"]:
                p.mul_(factor)
            attn.scaling = attn.scaling / factor
    return model


def projection_drift(model: nn.Module, start: list[dict]) -> dict[str, float]:
    """``{"k": ..., "v": ...}``: the largest ``‖P − P₀‖ / ‖P₀‖`` over the attentions, ``P``
    an attention's key (value) projection, weight and bias together; ``start`` is
    ``projection_snapshot(model)`` at step 0."""
    now = projection_snapshot(model)
    return {role: max(float((n[role] - s[role]).norm() / s[role].norm())
                      for n, s in zip(now, start)) for role in ("k", "v")}


def projection_snapshot(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Per attention, its key and value projections flattened into one vector each."""
    return [{role: torch.cat([t.detach().reshape(-1) for t in tensors]).clone()
             for role, tensors in key_value_parameters(attn).items()}
            for attn in _attentions(model)]


def large_key_lm(base: BenchLM, factor: float = 256.0) -> BenchLM:
    """``base`` with its keys ``× factor`` and the same function (``scale_keys``): a model
    whose cached keys exceed E4M3's 448 at scale 1.0, as real checkpoints' do (Qwen2's key
    biases: vLLM #11906), trained from the same pretrained point. The softmax scale takes the
    ``1/factor`` rather than ``W_Q``: Adam steps every weight by about its learning rate
    whatever the weight's size, so ``W_Q / factor`` would move ``factor`` times faster
    relative to itself, a different training run rather than a different magnitude."""

    def build() -> nn.Module:
        return scale_keys(base.build(), factor)

    return BenchLM(f"{base.name}, keys ×{factor:g}", build, base.batch, base.causal,
                   {**base.info, "key factor": factor})


def minilm_lm() -> BenchLM:
    """The real pretrained all-MiniLM-L6-v2, fed sentences from the stdlib docstrings."""
    import models_zoo

    zoo = models_zoo.get("minilm")
    state = {k: v.clone() for k, v in zoo.model.state_dict().items()}
    config, cls, tokenizer = zoo.model.config, type(zoo.model), zoo.tokenizer
    text = bytes(_corpus().val[:200_000].tolist()).decode("utf-8", "ignore")
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip().split()) >= 6]

    def build() -> nn.Module:
        fresh = cls(config)
        fresh.load_state_dict(state)
        return fresh.eval()

    def batch(gen, size, seq, split="val"):
        picks = torch.randint(0, len(lines), (size,), generator=gen).tolist()
        return dict(tokenizer([lines[i] for i in picks], padding=True, truncation=True,
                              max_length=seq, return_tensors="pt"))

    return BenchLM("minilm", build, batch, causal=False)
