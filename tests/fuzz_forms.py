"""Random attention blocks for fuzzing the analysis: a hypothesis strategy and one checker.

``forms()`` draws a :class:`Form`, a small self-attention block (d 32–64, 2–8 heads,
L 4–12) composed at random of: an input normalization (LayerNorm, RMSNorm, RMSNorm from
plain ops, Gemma's ``1 + w`` gain, the ``pow(·, -0.5)`` spelling, or none), random and
inflated gains and biases, projections (separate, fused and chunked, fused and interleaved
per kv head, GQA/MQA repeated or ``enable_gqa``, MLA-style down → RMSNorm → up, a LoRA
adapter on q or v), RoPE (rotate-half with ``cat``, pairs with ``stack`` + ``flatten`` or
``reshape_as``, partial), a per-head QK-norm, the softmax scale (1/√d_h multiplied or
divided, a custom constant, q and k or q alone pre-scaled), modifiers (causal mask added,
``masked_fill``, ``where``, boolean or ``is_causal`` for SDPA; ALiBi; softcap
``c·tanh(S/c)``; a sinks column; the ``max(S, finfo.min)`` floor) and eager or SDPA
attention. Each form states what the analysis must answer (:attr:`Form.expected`).

:func:`check_example` checks one form against the library's public entry points only, with
the block's own tensors as the reference (never the analysis'):

1. ``find_attention`` finds exactly one site; supported or refused as expected, and a
   refusal names its reason (a softmax over q·kᵀ is never missed, never silent);
2. gains and biases ×4, then gradient ascent on the input: the observed per-head
   ``max|S|`` (``S = s·q·kᵀ`` recomputed in float64 from the operands the block hands to
   its attention, then softcapped if the block caps) stays within ``site.logit_bound()``
   and the operands' ``max|q|, |k|, |v|`` within ``site.amax_bounds()``;
3. ``wrap(model, scaling="none", compiler=compiler)`` equals eager (``check_example``'s
   ``compiler``, aot_eager unless told);
4. (``audit=True``) geometry scaling with ``audit=True`` on the adversarial input reports
   0 ``overflow_steps``.

Example::

    >>> from tests.fuzz_forms import forms, check_example
    >>> result = check_example(forms().example())
    >>> result.ok
    True
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

import geoscale_fx
from geoscale_fx.numerics import amax, logit_bounds

NORMS = ("layernorm", "rmsnorm", "rms_decomposed", "gemma", "pow", "none")
PROJECTIONS = ("separate", "fused_chunk", "fused_interleaved", "mla", "lora_q", "lora_v")
REPEATS = ("repeat_interleave", "expand", "enable_gqa")
ROPES = ("none", "rotate_half", "stack_flatten", "reshape_as")
QK_NORMS = ("none", "rmsnorm", "decomposed")
SCALINGS = ("default", "div", "custom", "prescale_qk", "prescale_q")
EAGER_MASKS = ("none", "additive", "masked_fill", "where")
SDPA_MASKS = ("none", "is_causal", "additive", "bool")
#: the refusal an unnormalized block must get (a substring of ``site.reason``)
NO_NORMALIZATION = "no normalization"
BATCH = 2


@dataclass(frozen=True)
class Form:
    """One random attention block; every field selects one surface form."""
    d_model: int
    n_heads: int
    n_kv_heads: int
    seq: int
    norm: str
    spread: float           # gains 1 ± spread, biases ± spread
    qkv_bias: bool
    projection: str
    repeat: str             # how k/v reach n_heads when n_kv_heads < n_heads
    rank: int               # MLA latent / LoRA rank
    rope: str
    partial_rope: bool
    qk_norm: str
    scaling: str
    custom_scale: float
    attention: str          # "eager" | "sdpa"
    mask: str
    alibi: bool
    softcap: float          # 0: none
    sinks: bool
    floor: bool
    seed: int
    dtype: str = "float32"  # or "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def product_scale(self) -> float:
        """s with ``S = s · q_op · k_opᵀ`` for the operands the block hands to attention."""
        if self.scaling in ("prescale_qk", "prescale_q"):
            return 1.0
        return self.custom_scale if self.scaling == "custom" else self.head_dim ** -0.5

    @property
    def value_bounded(self) -> bool:
        """v is a projection of a normalized input (the layer input's or MLA's latent)."""
        return self.norm != "none" or self.projection == "mla"

    @property
    def expected(self) -> str:
        """``"supported"`` or the refusal (a substring of the site's reason)."""
        keys_normalized = self.value_bounded or self.qk_norm != "none"
        return "supported" if keys_normalized else NO_NORMALIZATION

    def features(self) -> list[str]:
        """``name=value`` labels of the surface forms this block uses (the bench's rows)."""
        out = [f"norm={self.norm}", f"projection={self.projection}",
               f"attention={self.attention}", f"scaling={self.scaling}", f"mask={self.mask}",
               f"rope={self.rope}" + ("+partial" if self.partial_rope and self.rope != "none"
                                      else ""),
               f"qk_norm={self.qk_norm}", f"qkv_bias={self.qkv_bias}", f"dtype={self.dtype}"]
        if self.n_kv_heads < self.n_heads:
            kind = "mqa" if self.n_kv_heads == 1 else "gqa"
            out.append(f"{kind}={self.repeat}")
        out += [m for m, on in (("alibi", self.alibi), ("softcap", self.softcap > 0),
                                ("sinks", self.sinks), ("floor", self.floor)) if on]
        return out

    @property
    def tolerance(self) -> float:
        """Relative slack of the checks: float32 rounding, or bf16's (operands rounded to
        2⁻⁸ relative before the float64 recomputation of S; norms computed in bf16)."""
        return 1e-5 if self.dtype == "float32" else 3e-2

    def build(self) -> "FuzzBlock":
        torch.manual_seed(self.seed)
        return FuzzBlock(self).eval().to(getattr(torch, self.dtype))

    def input(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + 1)
        return torch.randn(BATCH, self.seq, self.d_model, generator=g).to(getattr(torch,
                                                                                 self.dtype))


# --------------------------------------------------------------------------------------
# the strategy
# --------------------------------------------------------------------------------------

@st.composite
def forms(draw) -> Form:
    """A random :class:`Form` (constraints: SDPA has no softcap, sinks or floor;
    ``enable_gqa`` only with SDPA and fewer kv heads; head_dim even for RoPE)."""
    d_model = draw(st.sampled_from((32, 48, 64)))
    n_heads = draw(st.sampled_from([h for h in (2, 4, 8) if d_model % (2 * h) == 0]))
    n_kv = draw(st.sampled_from([n_heads] + [k for k in (1, 2, 4) if k < n_heads
                                             and n_heads % k == 0]))
    attention = draw(st.sampled_from(("eager", "sdpa")))
    eager = attention == "eager"
    repeats = REPEATS if not eager else REPEATS[:2]
    return Form(
        d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, seq=draw(st.integers(4, 12)),
        norm=draw(st.sampled_from(NORMS)), spread=draw(st.sampled_from((0.0, 0.5, 2.0))),
        qkv_bias=draw(st.booleans()), projection=draw(st.sampled_from(PROJECTIONS)),
        repeat=draw(st.sampled_from(repeats)), rank=draw(st.sampled_from((4, 8, 16))),
        rope=draw(st.sampled_from(ROPES)), partial_rope=draw(st.booleans()),
        qk_norm=draw(st.sampled_from(QK_NORMS[:1] + QK_NORMS)),
        scaling=draw(st.sampled_from(SCALINGS if eager else SCALINGS[:1] + SCALINGS[2:])),
        custom_scale=draw(st.sampled_from((0.05, 0.3, 1.0))), attention=attention,
        mask=draw(st.sampled_from(EAGER_MASKS if eager else SDPA_MASKS)),
        alibi=draw(st.booleans()),
        softcap=draw(st.sampled_from((0.0, 0.0, 5.0, 50.0))) if eager else 0.0,
        sinks=eager and draw(st.booleans()), floor=eager and draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 20)),
        dtype=draw(st.sampled_from(("float32",) * 4 + ("bfloat16",))))


def draw_forms(n: int, seed: int) -> list[Form]:
    """``n`` forms from :func:`forms`, reproducibly: hypothesis' generation phase only,
    seeded, no example database (what the bench runs). Hypothesis mutates earlier draws, so
    3n are drawn and n of them sampled (fewer near-duplicates)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    drawn = []

    @hypothesis_seed(seed)
    @settings(max_examples=3 * n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(forms())
    def collect(form):
        drawn.append(form)

    collect()
    return random.Random(seed).sample(drawn, min(n, len(drawn)))


# --------------------------------------------------------------------------------------
# the block
# --------------------------------------------------------------------------------------

class RMSNormOps(nn.Module):
    """RMSNorm from plain ops: ``x·rsqrt(mean(x²)+ε)·w``; ``gemma``: ``·(1 + w)``;
    ``pow``: ``x·pow(mean(x·x)+ε, -0.5)·w``."""

    def __init__(self, d: int, gemma: bool = False, pow_form: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d) if gemma else torch.ones(d))
        self.gemma, self.pow_form = gemma, pow_form

    def forward(self, x):
        if self.pow_form:
            x = x * torch.pow((x * x).mean(-1, keepdim=True) + 1e-6, -0.5)
        else:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * (1.0 + self.weight) if self.gemma else self.weight * x


def _norm(kind: str, d: int) -> nn.Module:
    return {"layernorm": lambda: nn.LayerNorm(d), "rmsnorm": lambda: nn.RMSNorm(d),
            "rms_decomposed": lambda: RMSNormOps(d), "gemma": lambda: RMSNormOps(d, gemma=True),
            "pow": lambda: RMSNormOps(d, pow_form=True), "none": nn.Identity,
            "decomposed": lambda: RMSNormOps(d)}[kind]()


def _rope_tables(seq: int, width: int, pairs: bool):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
    freqs = torch.arange(seq).float()[:, None] * inv_freq[None, :]        # (L, w/2)
    emb = freqs.repeat_interleave(2, dim=-1) if pairs else torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()                                           # (L, w)


def _turn(t: torch.Tensor, style: str) -> torch.Tensor:
    if style == "rotate_half":
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    if style == "stack_flatten":
        return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)
    return torch.stack([-t[..., 1::2], t[..., ::2]], dim=-1).reshape_as(t)


class FuzzBlock(nn.Module):
    """The self-attention block of a :class:`Form`; ``parts(x)`` also returns the q, k, v
    operands exactly as the attention receives them (no extra op: they are computed anyway)."""

    def __init__(self, form: Form):
        super().__init__()
        f, d, dh = form, form.d_model, form.head_dim
        self.form = f
        self.norm = _norm(f.norm, d)
        q_out, kv_out = f.n_heads * dh, f.n_kv_heads * dh
        if f.projection in ("fused_chunk", "fused_interleaved"):
            self.qkv = nn.Linear(d, q_out + 2 * kv_out, bias=f.qkv_bias)
        elif f.projection == "mla":
            self.q_down, self.q_latent = nn.Linear(d, f.rank, bias=False), nn.RMSNorm(f.rank)
            self.q_up = nn.Linear(f.rank, q_out, bias=f.qkv_bias)
            self.kv_down, self.kv_latent = nn.Linear(d, f.rank, bias=False), nn.RMSNorm(f.rank)
            self.kv_up = nn.Linear(f.rank, 2 * kv_out, bias=f.qkv_bias)
        else:
            self.q_proj = nn.Linear(d, q_out, bias=f.qkv_bias)
            self.k_proj = nn.Linear(d, kv_out, bias=f.qkv_bias)
            self.v_proj = nn.Linear(d, kv_out, bias=f.qkv_bias)
        if f.projection in ("lora_q", "lora_v"):
            self.lora_a = nn.Linear(d, f.rank, bias=False)
            self.lora_b = nn.Linear(f.rank, q_out if f.projection == "lora_q" else kv_out,
                                    bias=False)
        if f.qk_norm != "none":
            self.q_norm, self.k_norm = _norm(f.qk_norm, dh), _norm(f.qk_norm, dh)
        if f.sinks:
            self.sinks = nn.Parameter(torch.randn(f.n_heads) * 3)
        self.out = nn.Linear(q_out, d)
        self._randomize()

    def _randomize(self):
        """Gains 1 ± spread (Gemma's stored w: ± spread), norm and q/k/v biases ± spread,
        the LoRA B non-zero, ALiBi slopes' multiplier."""
        s = self.form.spread
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias") and not name.startswith("out"):
                    p.copy_(s * torch.randn_like(p))
                elif "norm" in name or "latent" in name:
                    owner = self.get_submodule(name.rsplit(".", 1)[0])
                    base = 0.0 if getattr(owner, "gemma", False) else 1.0
                    p.copy_(base + s * torch.randn_like(p))
                elif "lora_b" in name:
                    p.normal_(std=0.3)
        self.alibi_mult = float(torch.empty(()).uniform_(0.5, 8.0))

    def inflate_(self, factor: float = 4.0) -> "FuzzBlock":
        """Norm gains, q/k/v biases and sinks ×factor plus noise (makes bounds work)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.startswith("out") and ("norm" in name or "latent" in name
                                                   or name.endswith("bias") or name == "sinks"):
                    p.mul_(factor).add_(0.5 * torch.randn_like(p))
        return self

    def forward(self, x):
        return self.parts(x)[0]

    def parts(self, x):
        """(output, {"q", "k", "v"}: the attention's operands, (B, heads, L, d_h))."""
        B, L, _ = x.shape
        q, k, v = self._project(self.norm(x))                   # (B, H|K, L, d_h)
        if self.form.qk_norm != "none":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.form.rope != "none":
            q, k = self._rope(q), self._rope(k)
        if self.form.scaling == "prescale_qk":
            q, k = q * self.form.head_dim ** -0.25, k * self.form.head_dim ** -0.25
        elif self.form.scaling == "prescale_q":
            q = q * self.form.head_dim ** -0.5
        k, v = self._repeat(k), self._repeat(v)
        y = self._sdpa(q, k, v) if self.form.attention == "sdpa" else self._eager(q, k, v)
        return x + self.out(y.transpose(1, 2).reshape(B, L, -1)), {"q": q, "k": k, "v": v}

    def _project(self, h):
        f, (B, L, _) = self.form, h.shape
        H, K, dh = f.n_heads, f.n_kv_heads, f.head_dim
        if f.projection == "fused_chunk":
            qkv = self.qkv(h)
            q, k, v = qkv.chunk(3, dim=-1) if K == H else qkv.split([H * dh, K * dh, K * dh], -1)
        elif f.projection == "fused_interleaved":      # per kv head [q_1..q_G | k | v]
            t = self.qkv(h).view(B, L, K, (H // K + 2) * dh)
            q, k, v = t.split([H // K * dh, dh, dh], dim=-1)
        elif f.projection == "mla":
            q = self.q_up(self.q_latent(self.q_down(h)))
            k, v = self.kv_up(self.kv_latent(self.kv_down(h))).chunk(2, dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
            if f.projection == "lora_q":
                q = q + 2.0 * self.lora_b(self.lora_a(h))
            elif f.projection == "lora_v":
                v = v + 2.0 * self.lora_b(self.lora_a(h))
        return (q.reshape(B, L, H, dh).transpose(1, 2), k.reshape(B, L, K, dh).transpose(1, 2),
                v.reshape(B, L, K, dh).transpose(1, 2))

    def _rope(self, t):
        dh = t.shape[-1]
        width = max(2, dh // 4 * 2) if self.form.partial_rope else dh
        cos, sin = (c.to(t.dtype) for c in _rope_tables(t.shape[-2], width,
                                                         self.form.rope != "rotate_half"))
        rot = t[..., :width] * cos + _turn(t[..., :width], self.form.rope) * sin
        return torch.cat((rot, t[..., width:]), dim=-1) if self.form.partial_rope else rot

    def _repeat(self, t):
        f = self.form
        group = f.n_heads // f.n_kv_heads
        if group == 1 or f.repeat == "enable_gqa":
            return t
        if f.repeat == "repeat_interleave":
            return t.repeat_interleave(group, dim=1)
        B, K, L, dh = t.shape                                    # HF's repeat_kv
        return t[:, :, None].expand(B, K, group, L, dh).reshape(B, K * group, L, dh)

    def _alibi(self, L):
        H = self.form.n_heads
        slopes = self.alibi_mult * 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
        rel = (torch.arange(L)[None, :] - torch.arange(L)[:, None]).float()
        return (slopes[:, None, None] * rel).to(self.out.weight.dtype)    # (H, L, L)

    def _sdpa(self, q, k, v):
        f, L = self.form, q.shape[-2]
        causal = torch.full((L, L), float("-inf"), dtype=q.dtype).triu(1)
        mask = None
        if f.alibi:
            mask = self._alibi(L) + (causal if f.mask != "none" else 0.0)
        elif f.mask == "additive":
            mask = causal
        elif f.mask == "bool":
            mask = torch.ones(L, L, dtype=torch.bool).tril()
        scale = {"default": None, "custom": f.custom_scale}.get(f.scaling, 1.0)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=f.mask == "is_causal" and not f.alibi,
            scale=scale, enable_gqa=f.n_kv_heads < f.n_heads and f.repeat == "enable_gqa")

    def _eager(self, q, k, v):
        f, L = self.form, q.shape[-2]
        s = q @ k.transpose(-2, -1)                                      # (B, H, L, L)
        s = s / math.sqrt(f.head_dim) if f.scaling == "div" else s * f.product_scale
        if f.softcap:
            s = torch.tanh(s / f.softcap) * f.softcap
        if f.alibi:
            s = s + self._alibi(L)
        s = self._mask(s)
        if f.floor:
            s = torch.max(s, torch.tensor(torch.finfo(s.dtype).min))
        if not f.sinks:
            return torch.softmax(s, dim=-1) @ v
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, L, 1)
        s = torch.cat([s, sinks], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        return torch.softmax(s, dim=-1)[..., :-1] @ v

    def _mask(self, s):
        L, kind = s.shape[-1], self.form.mask
        keep = torch.ones(L, L, dtype=torch.bool).tril()
        if kind == "additive":
            return s + torch.full((L, L), torch.finfo(s.dtype).min, dtype=s.dtype).triu(1)
        if kind == "masked_fill":
            return s.masked_fill(~keep, float("-inf"))
        if kind == "where":
            return torch.where(keep, s, float("-inf"))
        return s


# --------------------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------------------

@dataclass
class ExampleResult:
    """What :func:`check_example` found for one form."""
    form: Form
    found: int = 0
    supported: Optional[bool] = None
    measured: Optional[bool] = None    # refused by the weights, run on its measured q and k
    reason: str = ""
    mismatch: str = ""                 # the answer differs from ``form.expected``
    gap: str = ""                      # v's amax bound missing (or present) unexpectedly
    violations: list = field(default_factory=list)
    worst: dict = field(default_factory=dict)     # role -> max observed/bound
    none_equals_eager: Optional[bool] = None
    none_max_diff: float = 0.0
    overflows: Optional[int] = None
    error: str = ""
    seconds: float = 0.0

    @property
    def silent_miss(self) -> bool:
        """The block's softmax over q·kᵀ not found, or refused without a reason."""
        return self.found == 0 or (self.supported is False and not self.reason.strip())

    @property
    def ok(self) -> bool:
        return not (self.silent_miss or self.mismatch or self.violations or self.error
                    or self.none_equals_eager is False or self.overflows)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(features=self.form.features(), silent_miss=self.silent_miss, ok=self.ok)
        return out


def check_example(form: Form, *, steps: int = 12, audit: bool = True,
                  bound_factor: float = 1.0, compiler: str = "aot_eager") -> ExampleResult:
    """Properties 1–4 of the module docstring on ``form``; never raises (``error``).

    ``bound_factor`` multiplies the library's bounds (< 1 checks that the search can fail);
    ``compiler`` runs the rewritten graphs of properties 3 and 4.
    """
    start, result = time.perf_counter(), ExampleResult(form)
    torch._dynamo.reset()
    try:
        model = form.build().inflate_(4.0)
        model.requires_grad_(False)
        x = form.input()
        site = _check_found(model, x, result)
        if site is not None and site.supported:
            x = _check_bounds(model, x, site, result, steps, bound_factor, form.tolerance)
        _check_none_equals_eager(model, x, result, compiler)
        if audit and site is not None and (site.supported or site.measured is not None):
            _check_audit(model, x, result, compiler)
    except Exception as e:  # noqa: BLE001 — the fuzzer reports every failure as data
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    result.seconds = time.perf_counter() - start
    return result


def _check_found(model, x, result):
    sites = geoscale_fx.find_attention(model, x)
    result.found = len(sites)
    if len(sites) != 1:
        result.mismatch = f"{len(sites)} sites found, 1 expected"
        return sites[0] if sites else None
    site = sites[0]
    result.supported, result.reason = site.supported, site.reason
    result.measured = not site.supported and site.measured is not None
    expected = result.form.expected
    if expected == "supported" and not site.supported:
        result.mismatch = "refused, supported expected"
    elif expected != "supported" and (site.supported or expected not in site.reason):
        result.mismatch = f"{'supported' if site.supported else 'other refusal'}, " \
                          f"refusal {expected!r} expected"
    elif site.supported and (site.value is not None) != result.form.value_bounded:
        result.gap = f"values bounded: {site.value is not None}, expected " \
                     f"{result.form.value_bounded} ({site.value_reason})"
    return site


def _observed(form: Form, ops: dict) -> dict:
    """Per head max|S| (query heads) and max|q| (query heads), |k|, |v| (kv heads), float64."""
    q, k, v = (ops[r].double() for r in "qkv")
    K = form.n_kv_heads

    def per_kv_head(t):
        a = t.abs().amax(dim=(0, 2, 3))                                  # (H or K,)
        return a.reshape(K, -1).amax(dim=-1)

    k_full = k if k.shape[1] == q.shape[1] else k.repeat_interleave(q.shape[1] // K, dim=1)
    s = form.product_scale * (q @ k_full.transpose(-1, -2))
    if form.softcap:
        s = torch.tanh(s / form.softcap) * form.softcap
    return {"logits": s.abs().amax(dim=(0, 2, 3)), "q": q.abs().amax(dim=(0, 2, 3)),
            "k": per_kv_head(k), "v": per_kv_head(v)}


def site_bounds(site, roles: str) -> tuple[torch.Tensor, dict]:
    """``(logit bound (n_q,), {role: amax bound})`` from the library's numerics."""
    return logit_bounds.site_logit_bound(site), amax.site_amax_bounds(site, roles=roles)


def _check_bounds(model, x, site, result, steps, factor, tol) -> torch.Tensor:
    """Gradient ascent on x of Σ_roles max_h observed/bound; returns the worst input."""
    logits, amax = site_bounds(site, "qkv" if site.value is not None else "qk")
    bounds = {r: b.double() * factor for r, b in {"logits": logits, **amax}.items()}
    x = x.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1)
    worst, worst_x, best_sum = {r: 0.0 for r in bounds}, x.detach().clone(), -1.0
    for _ in range(steps):
        observed = _observed(result.form, model.parts(x)[1])
        ratios = {r: (observed[r] / b).max() for r, b in bounds.items()}
        for r, ratio in ratios.items():
            worst[r] = max(worst[r], float(ratio.detach()))
        total = torch.stack(list(ratios.values())).sum()
        if float(total.detach()) > best_sum:
            best_sum, worst_x = float(total.detach()), x.detach().clone()
        opt.zero_grad()
        (-total).backward()
        opt.step()
    result.worst = worst
    result.violations = [f"{r}: observed/bound {v:.6g}" for r, v in worst.items()
                         if not v <= 1 + tol]
    return worst_x


def _check_none_equals_eager(model, x, result, compiler: str):
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        got = geoscale_fx.wrap(model, scaling="none", compiler=compiler)(x)
    # float32 rounding of a rewritten but equal computation scales with the output
    scale = max(1.0, float(expected.abs().max()))
    result.none_max_diff = float((got - expected).abs().max()) / scale
    tol = result.form.tolerance
    result.none_equals_eager = bool(torch.allclose(got, expected, rtol=tol, atol=tol * scale))


def _check_audit(model, x, result, compiler: str):
    torch._dynamo.reset()
    wrapped = geoscale_fx.wrap(model, compiler=compiler, audit=True)
    with torch.no_grad():
        wrapped(x)
    rows = geoscale_fx.report(wrapped, per_head=True).rows
    counts = [r["overflow_steps"] for r in rows
              if r.get("overflow_steps") is not None and r["head"] in (0, None)]
    result.overflows = sum(counts) if counts else None
    for r in rows:     # the in-graph bound (a measured one included) against what it scaled
        if r.get("max_scaled") is not None and r.get("bound") is not None and \
                r["max_scaled"] * r["scale"] > r["bound"] * (1 + result.form.tolerance):
            result.violations.append(f"audit head {r['head']}: max|S| "
                                     f"{r['max_scaled'] * r['scale']:.6g} > bound "
                                     f"{r['bound']:.6g}")
