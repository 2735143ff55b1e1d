"""Provenance: ``find_projection``, ``trace_normalized_input`` and ``head_rows`` on small
captured graphs (which projection feeds an operand, which normalization bounds its input, and
the per-head feature lists at the operand)."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

import geoscale_fx
from geoscale_fx.analysis.index import broadcast as bc
from geoscale_fx.analysis.fx.graph_ops import op_of, parameter_name
from geoscale_fx.analysis.index.index_replay import Unsupported
from geoscale_fx.analysis.sides.provenance import find_projection, head_rows
from tests.analysis_checks import Captured

B, L, D, H, DH = 2, 6, 32, 4, 8
EPS = 1e-6


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

def _capture(module: nn.Module) -> Captured:
    return Captured.of(module, torch.randn(B, L, D))


def _param(node) -> str:
    """Dotted parameter name of a channel-op operand (or the constant itself)."""
    return parameter_name(node) if isinstance(node, Node) else node


class HandRMSNorm(nn.Module):
    """``x * rsqrt(mean(x²) + eps) * w`` written out, or Gemma's ``… * (1 + w)``."""

    def __init__(self, form: str = "rsqrt"):
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.zeros(D) if form == "gemma" else torch.rand(D) + 0.5)

    def forward(self, x):
        if self.form == "rsqrt":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight
        if self.form == "div_sqrt":
            return self.weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + EPS))
        if self.form == "llama_casts":
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
            return self.weight * h.to(x.dtype)
        if self.form == "gemma":
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
            return h * (1.0 + self.weight)
        if self.form == "mean_over_tokens":
            return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + EPS) * self.weight
        raise ValueError(self.form)


class Normed(nn.Module):
    """``linear(after(dropout(norm(x))))`` viewed as heads; ``after`` sees the module."""

    def __init__(self, norm: nn.Module, after=None, p: float = 0.0):
        super().__init__()
        self.norm = norm
        self.drop = nn.Dropout(p)
        self.proj = nn.Linear(D, D)
        self.shift = nn.Parameter(torch.randn(D))
        self.after = after

    def forward(self, x):
        h = self.drop(self.norm(x))
        if self.after is not None:
            h = self.after(h, self)
        return (self.proj(h).view(B, L, H, DH).transpose(1, 2),)


# --------------------------------------------------------------------------------------
# trace_normalized_input
# --------------------------------------------------------------------------------------

NORMS = {
    # name: (norm factory, kind, norm node op, channel ops as (kind, parameter name))
    "layernorm_affine": (lambda: nn.LayerNorm(D), "layernorm", "layer_norm",
                         [("mul", "norm.weight"), ("add", "norm.bias")]),
    "layernorm_no_affine": (lambda: nn.LayerNorm(D, elementwise_affine=False), "layernorm",
                            "layer_norm", []),
    "layernorm_no_bias": (lambda: nn.LayerNorm(D, bias=False), "layernorm", "layer_norm",
                          [("mul", "norm.weight")]),
    "rmsnorm_fused": (lambda: nn.RMSNorm(D), "rmsnorm", "rms_norm", [("mul", "norm.weight")]),
    "rmsnorm_fused_no_affine": (lambda: nn.RMSNorm(D, elementwise_affine=False), "rmsnorm",
                                "rms_norm", []),
    "rmsnorm_hand_rsqrt": (lambda: HandRMSNorm("rsqrt"), "rmsnorm", "mul",
                           [("mul", "norm.weight")]),
    "rmsnorm_hand_div_sqrt": (lambda: HandRMSNorm("div_sqrt"), "rmsnorm", "div",
                              [("mul", "norm.weight")]),
    "rmsnorm_hand_llama_casts": (lambda: HandRMSNorm("llama_casts"), "rmsnorm", "mul",
                                 [("mul", "norm.weight")]),
}


@pytest.mark.parametrize("name", sorted(NORMS))
def test_normalizations_are_found_with_their_channel_ops(name):
    """LayerNorm (affine or not), fused nn.RMSNorm and hand-written RMSNorm forms are found;
    channel_ops list the norm's own gain/bias parameters in order; model_dim is d; no
    dropout means radius_factor 1."""
    factory, kind, node_op, channel_ops = NORMS[name]
    norm = _capture(Normed(factory())).normalized()
    assert norm.norm == kind
    assert op_of(norm.node) == node_op
    assert norm.model_dim == D
    assert [(k, _param(v)) for k, v in norm.channel_ops] == channel_ops
    assert norm.radius_factor == 1.0


def test_hand_written_rmsnorm_node_is_the_normalized_product():
    """For a decomposed RMSNorm the norm node is ``x * rsqrt(mean(x²)+eps)``, before the gain."""
    captured = _capture(Normed(HandRMSNorm("rsqrt")))
    norm = captured.normalized()
    assert op_of(norm.node.args[1]) == "rsqrt"
    assert norm.node.args[0].name == "l_x_"
    ((_, gain),) = norm.channel_ops
    (gain_mul,) = gain.users
    assert norm.node in gain_mul.args


def test_gemma_gain_is_one_plus_weight():
    """Gemma's ``* (1 + w)`` is one per-channel mul whose operand evaluates to 1 + w."""
    module = Normed(HandRMSNorm("gemma"))
    with torch.no_grad():
        module.norm.weight.copy_(torch.linspace(-0.5, 0.5, D))
    captured = _capture(module)
    norm = captured.normalized()
    assert norm.norm == "rmsnorm" and norm.model_dim == D
    ((kind, gain),) = norm.channel_ops
    assert kind == "mul" and op_of(gain) == "add" and captured.kinds.is_param(gain)
    torch.testing.assert_close(captured.value(gain), 1.0 + module.norm.weight.detach())


def test_channel_ops_after_the_norm_are_collected_in_order():
    """Scalar and per-channel mul/add/div/sub after the norm follow the norm's own gain and
    bias, in forward order; div and sub become mul by 1/c and add of -c."""
    after = lambda h, m: ((h * 2.0 + m.shift) / 4 - 1.0)  # noqa: E731
    norm = _capture(Normed(nn.LayerNorm(D), after)).normalized()
    assert norm.norm == "layernorm"
    assert [(k, _param(v)) for k, v in norm.channel_ops] == [
        ("mul", "norm.weight"), ("add", "norm.bias"), ("mul", 2.0), ("add", "shift"),
        ("mul", 0.25), ("add", -1.0)]


def test_feature_preserving_views_are_walked_through():
    """A token-flattening view, a transpose of leading dims and a cast keep the feature axis."""
    after = lambda h, m: h.reshape(B * L, D).view(B, L, D).transpose(0, 1).float() \
        .transpose(0, 1)  # noqa: E731
    norm = _capture(Normed(nn.RMSNorm(D), after)).normalized()
    assert norm.norm == "rmsnorm" and op_of(norm.node) == "rms_norm"
    assert len(norm.channel_ops) == 1


@pytest.mark.parametrize("p, train, factor", [
    (0.5, True, 2.0), (0.25, True, 4.0 / 3.0), (0.5, False, 1.0), (0.0, True, 1.0)])
def test_dropout_before_the_projection_scales_the_radius(p, train, factor):
    """Training-mode dropout(p) in front of the projection multiplies radius_factor by
    1/(1-p); in eval (or p=0) it stays 1."""
    module = Normed(nn.RMSNorm(D), p=p).train(train)
    norm = _capture(module).normalized()
    assert norm.norm == "rmsnorm"
    assert norm.radius_factor == pytest.approx(factor)
    assert [(k, _param(v)) for k, v in norm.channel_ops] == [("mul", "norm.weight")]


def test_offset_under_training_dropout_is_unsupported():
    """An offset added before a training-mode dropout is scaled by the dropout mask: refused."""
    module = Normed(nn.RMSNorm(D), after=lambda h, m: F.dropout(h + m.shift, 0.5, True)).train()
    with pytest.raises(Unsupported, match="an offset under training-mode dropout"):
        _capture(module).normalized()


def test_layernorm_bias_under_training_dropout_is_unsupported():
    """LayerNorm's own bias is scaled by a training-mode dropout mask after it: refused,
    naming the layer_norm node."""
    captured = _capture(Normed(nn.LayerNorm(D), p=0.5).train())
    (norm,) = [n for n in captured.gm.graph.nodes if op_of(n) == "layer_norm"]
    with pytest.raises(Unsupported, match="a normalization bias under training-mode dropout"
                       ) as info:
        captured.normalized()
    assert str(info.value).startswith(f"`{norm.name}`: ")


def test_layernorm_gain_without_bias_under_training_dropout_scales_the_radius():
    """Without a bias only LayerNorm's gain is under the mask (it commutes): radius_factor
    1/(1-p), channel_ops the gain alone."""
    norm = _capture(Normed(nn.LayerNorm(D, bias=False), p=0.5).train()).normalized()
    assert norm.norm == "layernorm"
    assert norm.radius_factor == pytest.approx(2.0)
    assert [(k, _param(v)) for k, v in norm.channel_ops] == [("mul", "norm.weight")]


class DroppedAttention(nn.Module):
    """``sdpa(q, k, k)`` with q, k = linear(dropout(norm(x))) viewed as heads."""

    def __init__(self, norm: nn.Module, p: float = 0.5):
        super().__init__()
        self.norm, self.drop = norm, nn.Dropout(p)
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.drop(self.norm(x))
        q = self.q(h).view(B, L, H, DH).transpose(1, 2)
        k = self.k(h).view(B, L, H, DH).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, k)


def test_layernorm_bias_under_training_dropout_is_bounded_by_value():
    """A LayerNorm bias under training-mode dropout is not a fixed offset (the mask scales it
    too), so the affine source does not hold: the site's source is bounded by value instead,
    ``(√d·max|g| + ‖β‖)/(1−p)``; the bias-free LayerNorm under the same dropout stays an
    affine source with radius_factor 2."""
    x = torch.randn(B, L, D)
    (site,) = geoscale_fx.find_attention(DroppedAttention(nn.LayerNorm(D)).train(), x)
    assert site.supported, site.reason
    assert site.q.source.norm == site.k.source.norm == "bounded"
    (site,) = geoscale_fx.find_attention(
        DroppedAttention(nn.LayerNorm(D, bias=False)).train(), x)
    assert site.supported, site.reason
    for side in (site.q, site.k):
        assert side.source.norm == "layernorm"
        assert side.source.radius_factor == pytest.approx(2.0)
        assert [kind for kind, _ in side.source.channel_ops] == ["mul"]


class Raw(nn.Module):
    """Projections of inputs that no normalization bounds."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.norm = nn.LayerNorm(D)
        self.norm2 = nn.LayerNorm((L, D))
        self.rms_over_tokens = HandRMSNorm("mean_over_tokens")
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        if self.form == "raw_input":
            h = x
        elif self.form == "residual":
            h = x + self.norm(x)
        elif self.form == "norm_over_tokens_and_features":
            h = self.norm2(x)
        elif self.form == "norm_over_half_features":
            h = F.layer_norm(x.view(B, L, 2, D // 2), (D // 2,)).view(B, L, D)
        elif self.form == "activation_gain":
            h = self.norm(x) * torch.sigmoid(x)
        else:
            h = self.rms_over_tokens(x)
        return (self.proj(h),)


UNNORMALIZED = {
    "raw_input": r"no normalization before the projection `linear`: reached `l_x_` "
                 r"\(placeholder\)",
    "residual": r"no normalization before the projection `linear`: reached `h` \(add\)",
    "norm_over_tokens_and_features": r"layer_norm over \(6, 32\) does not bound each token",
    "norm_over_half_features": "it mixes the feature dimension",
    "activation_gain": r"no normalization before the projection `linear`: reached `h` \(mul\)",
    "rms_mean_over_tokens": r"no normalization before the projection `linear`",
}


@pytest.mark.parametrize("form", sorted(UNNORMALIZED))
def test_unnormalized_inputs_are_unsupported(form):
    """No norm, a residual sum, a norm over more than the feature axis, a norm over part of it,
    an activation-dependent gain, or an RMS over the token axis: Unsupported with the reason."""
    with pytest.raises(Unsupported, match=UNNORMALIZED[form]):
        _capture(Raw(form)).normalized()


# --------------------------------------------------------------------------------------
# find_projection
# --------------------------------------------------------------------------------------

class Projections(nn.Module):
    """One operand per projection spelling, plus operands that are not one projection."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q = nn.Linear(D, D)
        self.q2 = nn.Linear(D, D, bias=False)
        self.w = nn.Parameter(torch.randn(D, D))
        self.b = nn.Parameter(torch.randn(D))
        self.lora_a = nn.Linear(D, 4, bias=False)
        self.lora_b = nn.Linear(4, D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return (
            self.q(h),                                            # linear with bias
            F.linear(h, self.q2.weight) + self.b,                 # bias written out
            h @ self.w,                                           # dense, no bias
            torch.addmm(self.b, h.view(B * L, D), self.w),        # dense with bias
            self.q(h) + self.q2(h),                               # two projections summed
            self.q2(h) + self.lora_b(self.lora_a(h)),             # LoRA adapter
            x.view(B, L, H, DH),                                  # the graph input itself
        )


@pytest.fixture(scope="module")
def projections() -> Captured:
    torch._dynamo.reset()
    return _capture(Projections())


@pytest.mark.parametrize("index, layout, weight, bias, root_op, x_op", [
    (0, "linear", "q.weight", "q.bias", "linear", "layer_norm"),
    (1, "linear", "q2.weight", "b", "add", "layer_norm"),
    (2, "dense", "w", None, "matmul", "layer_norm"),
    (3, "dense", "w", "b", "addmm", "view"),
])
def test_find_projection_recognises_each_spelling(projections, index, layout, weight, bias,
                                                  root_op, x_op):
    """linear, linear + written-out bias, x @ W and addmm are projections with their layout,
    weight and bias; the root is the node whose output features are indexed."""
    operand = projections.operands[index]
    (projection,), visited, units, assembled = find_projection(operand, projections.kinds,
                                                               "query")
    assert units == {} and assembled == {}   # no normalization after the projection
    assert op_of(projection.root) == root_op
    assert projection.layout == layout
    assert parameter_name(projection.weight) == weight
    assert (parameter_name(projection.bias) if projection.bias is not None else None) == bias
    assert op_of(projection.x) == x_op
    assert operand in visited and projection.root in visited


@pytest.mark.parametrize("index", [4, 5])
def test_sum_of_two_maps_of_the_source_is_recorded(projections, index):
    """A sum of two projections of the same input (two weights, or a LoRA adapter) reaches
    both roots; the track keeps the first one's features and the sum is recorded, feature by
    feature, for the analysis to fold into one effective weight."""
    operand = projections.operands[index]
    roots, *_ = find_projection(operand, projections.kinds, "query")
    assert len(roots) == 2
    records = projections.records()
    trace = projections.trace(operand, records)
    ((kept, added, ratio),) = records.sums
    assert ratio == 1.0
    offsets = dict((p.root, off) for p, off in trace.projections)
    first, second = (p.root for p, _ in trace.projections)
    torch.testing.assert_close(kept - offsets[first], added - offsets[second])
    assert set(bc.compact(trace.track.feat).reshape(-1).tolist()) == set(range(D))


def test_operand_without_projection_is_unsupported(projections):
    """An operand computed from the graph input alone names that input."""
    operand = projections.operands[6]
    with pytest.raises(Unsupported, match=r"is not a projection of a normalized input: it "
                                          r"comes from graph input `l_x_`"):
        find_projection(operand, projections.kinds, "key")


# --------------------------------------------------------------------------------------
# head_rows
# --------------------------------------------------------------------------------------

def _contiguous(n, offset=0, stride=DH):
    return tuple(tuple(range(offset + h * stride, offset + h * stride + DH)) for h in range(n))


class Heads(nn.Module):
    """Operands of several head layouts from one norm + one projection of width 3·D."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        p = self.qkv(self.norm(x))
        q = p[..., :D].view(B, L, H, DH).transpose(1, 2)
        per_head = p.view(B, L, H, 3 * DH)[..., DH:2 * DH].transpose(1, 2)
        kv = p[..., D:D + 2 * DH].view(B, L, 2, DH).transpose(1, 2)
        gqa = kv[:, :, None].expand(B, 2, 2, L, DH).reshape(B, H, L, DH)
        half = DH // 2
        scaled = torch.cat((q[..., :half] * 2.0, q[..., half:]), dim=-1)
        tokens_last = p[..., :D].view(B, L, H, DH).permute(0, 2, 3, 1)
        switched = torch.cat((q[:, :2, :3], q[:, 2:, 3:]), dim=2)
        return (q * 0.5, per_head, gqa, scaled, tokens_last, switched, p[0, 0])


@pytest.fixture(scope="module")
def heads() -> Captured:
    torch._dynamo.reset()
    return _capture(Heads())


@pytest.mark.parametrize("index, features, head_of_row, gain", [
    (0, _contiguous(H), [[0, 1, 2, 3]] * B, 0.5),
    (1, _contiguous(H, offset=DH, stride=3 * DH), [[0, 1, 2, 3]] * B, 1.0),
    (2, _contiguous(2, offset=D), [[0, 0, 1, 1]] * B, 1.0),
], ids=["separate_scaled", "interleaved_fused", "gqa_expanded"])
def test_head_rows_lists_features_per_head(heads, index, features, head_of_row, gain):
    """Per-head output features in first-appearance order, the head of every (batch, head)
    slice, and the uniform scalar gain."""
    operand = heads.operands[index]
    rows = head_rows(heads.track(operand), operand, "query")
    assert rows.features == features
    assert rows.head_of_row.tolist() == head_of_row
    assert rows.gain == pytest.approx(gain)
    assert rows.rotation == 0.0 and rows.partial_rotation is False


@pytest.mark.parametrize("index, reason", [
    (3, "is scaled non-uniformly"),
    (4, "mixes tokens within a head vector"),
    (5, "uses different weights at different positions"),
    (6, r"has shape \(96,\)"),
], ids=["non_uniform_gain", "tokens_in_last_dim", "heads_switch_mid_sequence", "one_dim"])
def test_head_rows_refuses_non_head_layouts(heads, index, reason):
    """Operands that are not (…, L, d_h) per-head slices of the projection are refused,
    naming the operand."""
    operand = heads.operands[index]
    with pytest.raises(Unsupported, match=reason) as info:
        head_rows(heads.track(operand), operand, "query")
    assert f"the query `{operand.name}`" in str(info.value)


class PartialRope(nn.Module):
    """RoPE on the first half of each head only (cat of rotated and pass-through parts)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.q = nn.Linear(D, D, bias=False)

    def forward(self, x):
        q = self.q(self.norm(x)).view(B, L, H, DH).transpose(1, 2)
        rot = DH // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        f = torch.arange(L).float()[:, None] * inv_freq[None, :]
        e = torch.cat((f, f), dim=-1)
        t, rest = q[..., :rot], q[..., rot:]
        turned = torch.cat((-t[..., rot // 2:], t[..., :rot // 2]), dim=-1)
        return (torch.cat((t * e.cos() + turned * e.sin(), rest), dim=-1),)


def test_head_rows_reports_partial_rotation():
    """Rotating part of each head gives rotation 1.0 and partial_rotation True, with the
    features still the contiguous head slices."""
    captured = _capture(PartialRope())
    (operand,) = captured.operands
    rows = head_rows(captured.track(operand), operand, "query")
    assert rows.features == _contiguous(H)
    assert rows.rotation == pytest.approx(1.0)
    assert rows.partial_rotation is True
    assert math.isclose(rows.gain, 1.0)


# --------------------------------------------------------------------------------------
# Operands with no projection, bounded by value (``bounded_root``)
# --------------------------------------------------------------------------------------

def test_a_learned_query_over_rmsnorm_keys_is_traced_to_the_values_it_views():
    from tests.attention_variants import LearnedQueryPooling

    site, = geoscale_fx.find_attention(LearnedQueryPooling().eval(), torch.randn(B, L, 64))
    assert site.supported, site.reason
    assert (site.q.source.norm, site.k.source.norm) == ("bounded", "rmsnorm")
    assert site.q.source.radius_expr[0] == "rows"         # the query parameter's rows
    assert site.value is not None and site.value.layout == "identity"


def test_keys_of_the_raw_input_stay_refused_with_the_reason():
    """The twin: the norm's gain on the raw input, no normalization — no weight or value
    bounds it, and the reason names the graph input."""
    from tests.attention_variants import LearnedQueryPooling

    site, = geoscale_fx.find_attention(LearnedQueryPooling(keys="raw").eval(),
                                       torch.randn(B, L, 64))
    assert not site.supported
    assert re.search(r"the key `\w+` is not a projection .* graph input `l_x_`", site.reason)


def test_a_query_that_repeats_channels_of_the_bounded_value_is_refused():
    """Each channel of w twice in the head vector: ‖q_h‖ = √2‖w‖ exceeds the rows' bound."""
    class Repeated(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.norm = nn.Parameter(torch.randn(D // 2)), nn.RMSNorm(D)

        def forward(self, x):
            k = self.norm(x)                                                  # (B, L, D)
            q = self.query.view(-1, 1).expand(-1, 2).reshape(1, D).expand(B, 1, D)
            return F.scaled_dot_product_attention(q, k, k)

    site, = geoscale_fx.find_attention(Repeated().eval(), torch.randn(B, L, D))
    assert not site.supported
    assert re.fullmatch(r"a head vector repeats channels of `\w*query\w*` \(broadcast along "
                        r"the features\).*", site.reason)


def test_a_query_scaled_by_the_input_stays_refused_with_the_graph_input_named():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.norm = nn.Parameter(torch.randn(D)), nn.RMSNorm(D)

        def forward(self, x):
            k = self.norm(x)                                                  # (B, L, D)
            q = (self.query * x[..., :1].sum()).expand(B, 1, D)              # (B, 1, D)
            return F.scaled_dot_product_attention(q, k, k)

    site, = geoscale_fx.find_attention(Scaled().eval(), torch.randn(B, L, D))
    assert not site.supported
    assert re.search(r"the query `q` is not a projection .* graph input `l_x_`", site.reason)


def test_keys_from_a_static_cache_filled_in_place_are_not_bounded_by_its_zeros():
    """``torch.zeros`` then ``index_copy_``: a constant before the write, keys after it —
    bounded by their observed norms, never by the zeros' value."""
    class StaticCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.q, self.k = nn.RMSNorm(D), nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            h = self.norm(x)
            q = self.q(h).view(B, L, H, DH).transpose(1, 2)                 # (B, H, L, dh)
            k = self.k(h).view(B, L, H, DH).transpose(1, 2)
            cache = torch.zeros(B, H, 16, DH)
            cache.index_copy_(2, torch.arange(L), k)
            return F.scaled_dot_product_attention(q, cache, cache)

    site, = geoscale_fx.find_attention(StaticCache().eval(), torch.randn(B, L, D))
    assert site.supported, site.reason
    assert site.k.layout == "observed"
