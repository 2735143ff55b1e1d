"""Small hand-written attention blocks that exercise the analysis beyond the model zoo.

Each builds attention from plain ops in a way no library model does, so a pass that keyed on
module names or one fixed pattern would miss them. ``VARIANTS`` maps a name to
``(factory, expected)`` where ``expected`` lists what the analysis must find.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

D, H = 64, 4
DH = D // H


class RMSNormDecomposed(nn.Module):
    """RMSNorm from plain ops: ``x·rsqrt(mean(x²)+ε)``; ``style="pow"`` writes it as Gemma 4
    does (``x·pow(mean(x.pow(2))+ε, -0.5)``), ``style="square"`` as DeepSeek-V4
    (``x·rsqrt(mean(x.square())+ε)``)."""

    def __init__(self, d, gemma=False, style="rsqrt"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d) if gemma else torch.ones(d))
        self.gemma, self.style = gemma, style

    def forward(self, x):
        x = x.float()
        if self.style == "pow":
            x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
        elif self.style == "square":
            x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
        else:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * (1.0 + self.weight) if self.gemma else self.weight * x


def _rope_tables(seq_len, dh, interleaved=False):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
    freqs = torch.arange(seq_len).float()[:, None] * inv_freq[None, :]   # (L, dh/2)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()                                          # (L, dh)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rotate_every_two_as(x):
    """RoFormer's form: the swapped pairs reshaped like ``x`` itself (``reshape_as``)."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape_as(x)


class Block(nn.Module):
    """A configurable self-attention block; each flag selects one surface form."""

    def __init__(self, *, norm="layernorm", layout="separate", attn="sdpa", rope=None,
                 prescale=False, qk_bias=False, gqa=1, partial_rope=False, qk_norm=None,
                 broadcast_kv=False):
        super().__init__()
        self.norm = {"layernorm": nn.LayerNorm(D), "rmsnorm": nn.RMSNorm(D),
                     "rms_decomposed": RMSNormDecomposed(D),
                     "gemma": RMSNormDecomposed(D, gemma=True),
                     "gemma_pow": RMSNormDecomposed(D, style="pow"),
                     "none": nn.Identity()}[norm]
        # a per-head RMSNorm of q and k (QK-norm) written in style ``qk_norm``
        self.q_norm = RMSNormDecomposed(DH, style=qk_norm) if qk_norm else None
        self.k_norm = RMSNormDecomposed(DH, style=qk_norm) if qk_norm else None
        self.layout, self.attn, self.rope, self.prescale = layout, attn, rope, prescale
        if attn == "multiplied":
            self.register_buffer("causal", torch.ones(64, 64).tril().view(1, 1, 64, 64))
        self.kv_heads = H // gqa
        # one key/value head left for SDPA to broadcast over the query heads (Falcon's
        # multi-query attention: no repeat, no enable_gqa)
        self.broadcast_kv = broadcast_kv
        self.partial_rope = partial_rope
        if layout == "separate":
            self.q = nn.Linear(D, D, bias=qk_bias)
            self.k = nn.Linear(D, self.kv_heads * DH, bias=qk_bias)
            self.v = nn.Linear(D, self.kv_heads * DH, bias=qk_bias)
        else:
            self.qkv = nn.Linear(D, 3 * D, bias=qk_bias)
        self.out = nn.Linear(D, D)

    def _qkv(self, x):
        B, L, _ = x.shape
        if self.layout == "separate":
            q = self.q(x).view(B, L, H, DH).transpose(1, 2)                  # (B, H, L, dh)
            k = self.k(x).view(B, L, self.kv_heads, DH).transpose(1, 2)
            v = self.v(x).view(B, L, self.kv_heads, DH).transpose(1, 2)
        elif self.layout == "fused_chunk":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k, v = (t.reshape(B, L, H, DH).permute(0, 2, 1, 3) for t in (q, k, v))
        else:  # "interleaved": per head [q_h | k_h | v_h] in the fused output
            qkv = self.qkv(x).view(B, L, H, 3 * DH)                          # (B, L, H, 3dh)
            q, k, v = qkv.split(DH, dim=-1)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return q, k, v

    def _apply_rope(self, q, k):
        L = q.shape[-2]
        rot = DH // 2 if self.partial_rope else DH
        cos, sin = _rope_tables(L, rot, interleaved=self.rope in ("interleaved", "roformer"))
        turn = {"interleaved": _rotate_every_two, "roformer": _rotate_every_two_as}.get(
            self.rope, _rotate_half)

        def apply(t):
            t_rot, t_pass = t[..., :rot], t[..., rot:]
            t_rot = t_rot * cos + turn(t_rot) * sin
            return torch.cat((t_rot, t_pass), dim=-1) if self.partial_rope else t_rot

        return apply(q), apply(k)

    def forward(self, x):
        B, L, _ = x.shape
        h = self.norm(x)
        q, k, v = self._qkv(h)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = self._apply_rope(q, k)
        if self.kv_heads != H and not self.broadcast_kv:
            k = k.repeat_interleave(H // self.kv_heads, dim=1)
            v = v.repeat_interleave(H // self.kv_heads, dim=1)
        y = self._attend(q, k, v, B, L)
        return x + self.out(y.transpose(1, 2).reshape(B, L, D))

    def _attend(self, q, k, v, B, L):
        scale = 1.0 / math.sqrt(DH)
        if self.prescale:  # scale both sides by d_h^{-1/4} before the product
            q, k = q * DH ** -0.25, k * DH ** -0.25
            scale = 1.0
        if self.attn == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        if self.attn == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
            mask = torch.ones(L, L, dtype=torch.bool).tril()
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            return torch.einsum("bhqk,bhkd->bhqd", p, v)
        if self.attn == "bmm":  # heads merged into the batch dimension
            qb = q.reshape(B * H, L, DH)
            kb = k.reshape(B * H, L, DH)
            s = torch.bmm(qb, kb.transpose(1, 2)) / math.sqrt(DH) if not self.prescale \
                else torch.bmm(qb, kb.transpose(1, 2))
            s = s + torch.full((L, L), float("-inf")).triu(1)
            p = F.softmax(s.float(), dim=-1).to(q.dtype)
            return torch.bmm(p, v.reshape(B * H, L, DH)).view(B, H, L, DH)
        s = (q @ k.transpose(-2, -1)) * scale
        if self.attn == "multiplied":   # GPT-1: S·b + (-1e4)·(1 - b), b a 0/1 causal buffer
            b = self.causal[:, :, :L, :L]
            s = s * b + -1e4 * (1 - b)
            return F.softmax(s, dim=-1) @ v
        if self.attn == "floored":   # XGLM: an additive mask, then a floor at finfo.min
            s = s + torch.full((L, L), torch.finfo(s.dtype).min).triu(1)
            s = torch.max(s, torch.full((), torch.finfo(s.dtype).min))
            return F.softmax(s, dim=-1) @ v
        if self.attn == "zeroed":   # CPM-Ant: the masked probabilities zeroed again
            keep = torch.ones(L, L, dtype=torch.bool).tril()
            p = F.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
            return p.masked_fill(~keep, torch.scalar_tensor(0.0)) @ v
        s = torch.where(torch.ones(L, L, dtype=torch.bool).tril(), s, float("-inf"))
        return F.dropout(F.softmax(s, dim=-1), p=0.0) @ v


class Unnormalized(nn.Module):
    """Attention straight on the residual stream: no normalization bounds ‖x‖."""

    def __init__(self):
        super().__init__()
        self.block = Block(norm="none")

    def forward(self, x):
        return self.block(x)


class SoftmaxClassifier(nn.Module):
    """A softmax over class logits and a matmul with a parameter: not attention."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, 10)
        self.proto = nn.Parameter(torch.randn(10, D))

    def forward(self, x):
        p = F.softmax(self.head(self.ln(x)), dim=-1)        # (B, L, 10)
        return p @ self.proto                               # looks like ·V, but V is a weight


class QueryIsInput(nn.Module):
    """softmax(x xᵀ) x: shaped like attention, but no projection produces the query."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        h = self.ln(x)
        return F.softmax(h @ h.transpose(-2, -1), dim=-1) @ h


class RawQueryIsInput(nn.Module):
    """softmax(x xᵀ) x on the raw input: no projection and nothing bounds the query."""

    def forward(self, x):
        return F.softmax(x @ x.transpose(-2, -1), dim=-1) @ x


class KVCache(nn.Module):
    """Keys concatenated with a cache passed in by the caller."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, past_k):
        B, L, _ = x.shape
        q, k, v = self.block._qkv(self.block.norm(x))
        k = torch.cat([past_k, k], dim=-2)
        v = torch.cat([past_k, v], dim=-2)
        return F.scaled_dot_product_attention(q, k, v)


class LoRAQuery(nn.Module):
    """The query is the sum of two projections (a LoRA adapter)."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.lora_a = nn.Linear(D, 4, bias=False)
        self.lora_b = nn.Linear(4, D, bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        h = self.block.norm(x)
        q = (self.block.q(h) + self.lora_b(self.lora_a(h))).view(B, L, H, DH).transpose(1, 2)
        _, k, v = self.block._qkv(h)
        return F.scaled_dot_product_attention(q, k, v)


class EmbeddedTokens(nn.Module):
    """A first layer (GPT-1, Marian): a token-embedding gather plus a learned position
    embedding feed the projections, no normalization before them (‖x‖ is bounded by the two
    tables' largest rows). The token of each position is ``argmax`` of the input's features,
    so a float input picks any row."""

    def __init__(self, vocab=D, positions=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(positions, D)
        self.block = Block(norm="none")

    def forward(self, x):
        ids = x.argmax(dim=-1)                                               # (B, L)
        h = self.tok(ids) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.block(F.dropout(h, p=0.1, training=self.training))


class EmbeddingProjection(nn.Module):
    """ELECTRA / RemBERT: the embedding LayerNorm, then a Linear embedding projection
    (E → D) in front of the attention (‖x‖ ≤ σ_max(P)·(√E·max|g| + ‖β‖) + ‖b‖)."""

    E = D // 2

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(self.E)
        self.project = nn.Linear(self.E, D)
        self.block = Block(norm="none")

    def forward(self, x):
        return self.block(self.project(self.norm(x[..., :self.E])))


class PaddingMasked(nn.Module):
    """XLM: the LayerNorm output multiplied in place by a 0/1 padding mask that a comparison
    made (``tensor *= mask.unsqueeze(-1).to(dtype)``): ‖m·x‖ ≤ ‖x‖."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.block = Block(norm="none")

    def forward(self, x):
        mask = x[..., 0] > -1.0                                              # (B, L) bool
        h = self.norm(x)
        h *= mask.unsqueeze(-1).to(h.dtype)
        return self.block(h)


class L2Clip(nn.Module):
    """Inkling-2's ``ScaledL2Clip``: ``h = x ⊙ g`` (a per-head gain, or none), then
    ``h·min(1, t/(‖h‖+ε))`` spelled ``style`` ("clamp": ``.clamp(max=1)``, "clamp_max",
    "function": ``torch.clamp(r, None, 1)``; "normalized": ZAYA's ``t·h/‖h‖.clamp_min(ε)``;
    "floored": ``clamp(min=0.5, max=1)``, which does not bound ``‖h‖`` — the negative twin)."""

    def __init__(self, t, heads=None, style="clamp"):
        super().__init__()
        self.t, self.style = t, style
        self.scale = nn.Parameter(torch.ones(heads, DH)) if heads else None

    def forward(self, h):
        dtype, h = h.dtype, h.float()
        if self.scale is not None:
            h = h * self.scale.float()
        if self.style == "normalized":     # ZAYA's QK-norm: t·h / max(‖h‖, ε), no cap
            return (h * (self.t / h.norm(p=2, dim=-1, keepdim=True).clamp_min(1e-7))).to(dtype)
        r = self.t / (torch.linalg.vector_norm(h, dim=-1, keepdim=True) + 1e-6)
        r = {"clamp": lambda: r.clamp(max=1.0), "clamp_max": lambda: torch.clamp_max(r, 1.0),
             "function": lambda: torch.clamp(r, None, 1.0),
             "floored": lambda: r.clamp(min=0.5, max=1.0)}[self.style]()
        return (h * r).to(dtype)


class ClippedConvKey(nn.Module):
    """Inkling-2: q = L2Clip(q_proj(x)) and k = L2Clip(conv(k_proj(x))) per head, so
    ‖q_h‖, ‖k_h‖ ≤ t whatever the short causal convolution on k did; optionally a sink
    logit per query and head computed from the normalized input (``sink_proj(x)``) joined
    to the scores; ``sink="raw"`` reads the un-normalized input instead (negative twin)."""

    def __init__(self, t=3.0, style="clamp", sink=None):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.conv = nn.Conv1d(D, D, 3, groups=D, padding=2, bias=False)
        self.q_clip, self.k_clip = L2Clip(t, H, style), L2Clip(t, None, style)
        self.sink_kind = sink
        self.sink = nn.Linear(D, H) if sink else None
        # ZAYA: a learned per-head key temperature after the normalization
        self.temp = nn.Parameter(torch.full((H,), 1.5)) if style == "normalized" else None

    def forward(self, x):
        B, L, _ = x.shape
        h = self.norm(x)
        k = self.conv(self.k(h).transpose(1, 2))[..., :L].transpose(1, 2)     # (B, L, D)
        q = self.q_clip(self.q(h).view(B, L, H, DH)).transpose(1, 2)         # (B, H, L, dh)
        k = self.k_clip(k.view(B, L, H, DH)).transpose(1, 2)
        if self.temp is not None:
            k = k * self.temp[None, :, None, None]
        v = self.v(h).view(B, L, H, DH).transpose(1, 2)
        s = q @ k.transpose(-1, -2) * DH ** -0.5
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        if self.sink is None:
            return (F.softmax(s, -1) @ v).transpose(1, 2).reshape(B, L, D)
        sinks = self.sink(x if self.sink_kind == "raw" else h)                 # (B, L, H)
        s = torch.cat([s, sinks.transpose(1, 2).unsqueeze(-1)], dim=-1)      # (B, H, L, L+1)
        p = F.softmax(s.float(), dim=-1)[..., :-1]
        return (p @ v).transpose(1, 2).reshape(B, L, D)


class LearnedQueryPooling(nn.Module):
    """Attention pooling with learned queries (Inkling-2's block attention residual, split
    into heads): the queries are a parameter and the keys/values the RMSNorm'd input, neither
    projected — ‖q_h‖ ≤ max_r ‖w_r‖, ‖k_h‖ ≤ √D·max|g|. ``keys="raw"`` attends over the input
    times the norm's gain, without the normalization: nothing bounds it (the negative twin;
    the bare input would be keys passed in, bounded by their observed norms)."""

    def __init__(self, keys="normalized", queries=2):
        super().__init__()
        self.query = nn.Parameter(torch.randn(queries, D))
        self.norm = nn.RMSNorm(D)
        self.keys = keys

    def forward(self, x):
        B, L, _ = x.shape
        h = self.norm(x) if self.keys == "normalized" else x * self.norm.weight
        kv = h.view(B, L, H, DH).transpose(1, 2)                              # (B, H, L, dh)
        q = self.query.view(-1, H, DH).transpose(0, 1).expand(B, -1, -1, -1)  # (B, H, nq, dh)
        out = F.scaled_dot_product_attention(q, kv, kv)                       # (B, H, nq, dh)
        return out.transpose(1, 2).reshape(B, -1, D)                          # (B, nq, D)


class StackedStatesPooling(nn.Module):
    """Inkling-2's form itself: every position attends over its stack of states with one
    learned query shared by all positions (the batch dims of SDPA are (B, L), the keys an
    unweighted RMSNorm written out)."""

    N = 4

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(D // self.N))

    def forward(self, x):
        B, L, _ = x.shape
        stacked = x.view(B, L, self.N, D // self.N).float()                  # (B, L, n, d)
        stacked = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + 1e-6)
        d = stacked.shape[-1]
        q = self.query.float().view(-1, d).expand(B, L, -1, -1)               # (B, L, 1, d)
        out = F.scaled_dot_product_attention(q, stacked, stacked, scale=d ** -0.5)
        return out.reshape(B, L, d)


def block(**kw):
    return lambda: Block(**kw)


#: name -> (factory, {expected fields})
VARIANTS = {
    "layernorm_sdpa": (block(), dict(norm="layernorm", n_kv_heads=H)),
    "rmsnorm_fused": (block(norm="rmsnorm"), dict(norm="rmsnorm")),
    "rms_decomposed_explicit": (block(norm="rms_decomposed", attn="explicit"),
                                dict(norm="rmsnorm")),
    "gemma_gain": (block(norm="gemma"), dict(norm="rmsnorm")),
    "fused_chunk_bias": (block(layout="fused_chunk", qk_bias=True), dict(norm="layernorm")),
    "interleaved_fused": (block(layout="interleaved", qk_bias=True), dict(norm="layernorm")),
    "einsum": (block(attn="einsum"), dict()),
    "bmm_merged_heads": (block(attn="bmm"), dict()),
    "prescaled_qk": (block(prescale=True, attn="explicit"), dict(softmax_scale=DH ** -0.5)),
    "prescaled_bmm": (block(prescale=True, attn="bmm"), dict(softmax_scale=DH ** -0.5)),
    "rope_rotate_half_gqa": (block(rope="half", gqa=2, norm="rmsnorm"),
                             dict(rope=True, n_kv_heads=H // 2)),
    # Falcon: k, v of one head (B, 1, L, dh) broadcast by SDPA against H query heads
    "multi_query_broadcast": (block(gqa=H, broadcast_kv=True, norm="rmsnorm"),
                              dict(n_kv_heads=1)),
    "rope_interleaved": (block(rope="interleaved", attn="explicit"), dict(rope=True)),
    "rope_partial": (block(rope="half", partial_rope=True), dict(rope=True)),
    "floored_mask": (block(attn="floored"), dict(has_mask=True)),
    # GPT-1 (openai-gpt): a multiplicative 0/1 causal mask, S·b + (-1e4)·(1 - b)
    "multiplied_mask": (block(attn="multiplied"), dict(has_mask=True)),
    # CPM-Ant: masked probabilities zeroed again after the softmax
    "zeroed_probabilities": (block(attn="zeroed"), dict(has_mask=True)),
    "rope_reshape_as": (block(rope="roformer", attn="explicit"), dict(rope=True)),
    # Gemma 4: RMSNorm's rsqrt written as pow(·, -0.5), before the projections and as QK-norm
    "qk_norm_pow_rope": (block(norm="gemma_pow", qk_norm="pow", rope="half"),
                         dict(rope=True, norm="rmsnorm", model_dim=DH)),
    # DeepSeek-V4: mean(x.square()) as the mean square of a QK-norm
    "qk_norm_square": (block(norm="rmsnorm", qk_norm="square", attn="explicit"),
                       dict(norm="rmsnorm", model_dim=DH)),
    # no normalization before the projections: ‖x‖ bounded by the parameters' values
    "embedding_gather": (EmbeddedTokens, dict(norm="bounded")),
    "embedding_projection": (EmbeddingProjection, dict(norm="bounded")),
    "padding_mask": (PaddingMasked, dict(norm="bounded")),
    # Inkling-2: L2-clipped q and k (a short convolution on k), ‖q_h‖, ‖k_h‖ ≤ t
    "l2_clip_conv_key": (ClippedConvKey, dict(norm="l2clip", model_dim=DH)),
    "l2_clip_function": (lambda: ClippedConvKey(style="function"),
                         dict(norm="l2clip", model_dim=DH)),
    # ZAYA: q, k normalized to norm t (t/max(‖h‖, ε)), a per-head temperature on k after
    "scaled_l2_norm": (lambda: ClippedConvKey(style="normalized"),
                       dict(norm="l2clip", model_dim=DH)),
    # ... and a sink logit per query and head projected from the normalized input
    "projected_sink": (lambda: ClippedConvKey(sink="normalized"),
                       dict(norm="l2clip", model_dim=DH)),
    # no projection at all: a learned query over RMSNorm'd keys, each head a slice of them
    "learned_query_pooling": (LearnedQueryPooling,
                              dict(norm="bounded", n_kv_heads=H)),
    "stacked_states_pooling": (StackedStatesPooling,
                               dict(norm="bounded", n_q_heads=1, n_kv_heads=1,
                                    model_dim=DH)),
}
