"""A nanoGPT-style causal language model (after Karpathy's nanoGPT ``model.py``, written fresh).

Pre-LN transformer: token + position embeddings, ``n_layer`` blocks of
``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, a final LayerNorm and an lm_head tied to the
token embedding. Attention uses one fused ``c_attn`` projection (d → 3d) split into q, k, v
(``qkv="separate"``: three projections ``c_q``, ``c_k``, ``c_v``, the layout tensor
parallelism shards by heads with ``ColwiseParallel``, ``c_proj`` ``RowwiseParallel``; the
views use ``-1`` heads, so a rank sees its local ones), and one of two lowerings:

- ``attn_impl="sdpa"``: ``F.scaled_dot_product_attention(..., is_causal=True)``, the form a
  fused kernel sees;
- ``attn_impl="explicit"``: ``softmax(mask(q kᵀ · 1/√d_h)) · v`` written out, the form the
  graph passes must recognise without an SDPA call.

Both give the same logits for the same weights (eval mode).

KV cache: ``model(idx, past_key_values=past, use_cache=True)`` returns ``(logits, loss,
present)`` where ``past``/``present`` hold one ``(k, v)`` pair per layer, each
``(B, n_head, T_past, hs)``; ``idx`` then holds the new tokens only (positions
``T_past … T_past + T - 1``). Without ``use_cache`` the model returns ``(logits, loss)``.

    >>> model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64))
    >>> logits, loss = model(torch.randint(0, 256, (2, 8)))
    >>> logits.shape
    torch.Size([2, 8, 256])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "CausalSelfAttention", "MLP", "Block", "KVCache"]

ATTN_IMPLS = ("sdpa", "explicit")
QKV_LAYOUTS = ("fused", "separate")

#: one ``(k, v)`` pair per layer, each ``(B, n_head, T_past, hs)``
KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    attn_impl: str = "sdpa"
    qkv: str = "fused"

    def __post_init__(self):
        if self.qkv not in QKV_LAYOUTS:
            raise ValueError(f"qkv={self.qkv!r}; allowed values: {QKV_LAYOUTS}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r}; allowed values: {ATTN_IMPLS}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout}; allowed values: [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attn_impl = config.attn_impl
        self.qkv = config.qkv
        if config.qkv == "fused":
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        else:
            self.c_q, self.c_k, self.c_v = (nn.Linear(config.n_embd, config.n_embd,
                                                      bias=config.bias) for _ in range(3))
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        if self.attn_impl == "explicit":
            causal = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", causal.view(1, 1, config.block_size, config.block_size),
                                 persistent=False)  # (1, 1, block_size, block_size)

    def forward(self, x: torch.Tensor, layer_past: tuple | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``(y, (k, v))`` for ``x (B, T, C)``: ``k, v`` are the keys and values of the past
        (``layer_past``, each ``(B, nh, T_past, hs)``) followed by those of ``x``."""
        B, T, C = x.size()
        hs = C // self.n_head
        if self.qkv == "fused":
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 × (B, T, C)
        else:  # under tensor parallelism each is this rank's heads: (B, T, C / tp)
            q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        past = 0
        if layer_past is not None:
            past = layer_past[0].size(-2)
            k = torch.cat([layer_past[0], k], dim=-2)  # (B, nh, T_past + T, hs)
            v = torch.cat([layer_past[1], v], dim=-2)  # (B, nh, T_past + T, hs)
        y = self._attend(q, k, v, past)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y)), (k, v)

    def _attend(self, q, k, v, past: int) -> torch.Tensor:
        """Causal attention of ``q (B, nh, T, hs)`` at positions ``past … past + T - 1`` over
        ``k, v (B, nh, past + T, hs)``."""
        T, total = q.size(-2), k.size(-2)
        if self.attn_impl == "sdpa":
            dropout = self.dropout if self.training else 0
            if past == 0:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                      is_causal=True)
            # is_causal aligns the triangle top-left; with a past it must end bottom-right.
            # One new token sees every key: no mask at all.
            mask = None if T == 1 else torch.ones(T, total, dtype=torch.bool,
                                                  device=q.device).tril(diagonal=past)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, total)
        att = att.masked_fill(self.bias[:, :, past:total, :total] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v  # (B, nh, T, hs)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, layer_past: tuple | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``(x', (k, v))``: the block's output and its layer's keys and values (see
        ``CausalSelfAttention.forward``)."""
        y, present = self.attn(self.ln_1(x), layer_past)
        x = x + y
        return x + self.mlp(self.ln_2(x)), present


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections: std 0.02/√(2·n_layer).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False):
        """Logits ``(B, T, vocab)`` for token ids ``idx (B, T)``, and the mean cross-entropy
        against ``targets (B, T)`` when given (else ``None``). With ``past_key_values`` the
        tokens continue a sequence of ``T_past`` tokens whose keys and values it holds; with
        ``use_cache`` the keys and values of the whole sequence are returned third."""
        B, T = idx.size()
        past = 0 if past_key_values is None else past_key_values[0][0].size(-2)
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} (past {past} + {T}) > block_size "
                             f"{self.config.block_size}")
        pos = torch.arange(past, past + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        layers_past = past_key_values or (None,) * len(self.transformer.h)
        present = []
        for block, layer_past in zip(self.transformer.h, layers_past):
            x, kv = block(x, layer_past)
            if use_cache and layer_past is None:   # the layout cat gives: one decode graph
                kv = (kv[0].contiguous(), kv[1].contiguous())
            present.append(kv)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return (logits, loss, tuple(present)) if use_cache else (logits, loss)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None, do_sample: bool = True,
                 use_cache: bool = False) -> torch.Tensor:
        """Sample (or with ``do_sample=False`` pick greedily) ``max_new_tokens`` tokens after
        ``idx (B, T)``; returns ``(B, T + new)``.

        ``use_cache``: the prompt once, then one token per call with the KV cache. When the
        sequence outgrows ``block_size`` the cache is dropped and the cropped context
        recomputed, exactly as without a cache (so both give the same tokens).
        """
        cache = None
        for _ in range(max_new_tokens):
            if cache is not None and cache[0][0].size(-2) >= self.config.block_size:
                cache = None
            context = idx[:, -self.config.block_size:] if cache is None else idx[:, -1:]
            if use_cache:
                logits, _, cache = self(context, past_key_values=cache, use_cache=True)
            else:
                logits, _ = self(context)
            next_id = self._next_token(logits[:, -1, :], temperature, generator, do_sample)
            idx = torch.cat((idx, next_id), dim=1)
        return idx

    @staticmethod
    def _next_token(logits, temperature, generator, do_sample) -> torch.Tensor:
        """``(B, 1)`` ids from the last position's ``logits (B, vocab)``."""
        if not do_sample:
            return logits.argmax(dim=-1, keepdim=True)
        probs = F.softmax(logits / temperature, dim=-1)  # (B, vocab)
        return torch.multinomial(probs, num_samples=1, generator=generator)
