"""Analyzers of the attentions Dynamo keeps as one opaque op: their weights are arguments.

Two forms, each a function ``(Candidate, ValueKinds, evaluator, order) -> dict`` of
``AttentionSite`` fields with one term: the query and key sides are the rows of the packed
input projection, head ``h`` its rows ``[h·d_h, (h+1)·d_h)`` (the keys' ``embed_dim`` further
in a packed weight), and the softmax scale is ``1/√d_h``.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.fx import Node

from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, arg, shape_of
from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.sides.operand_sides import projection_side, source_of
from geoscale_fx.analysis.sides.provenance import (
    HeadRows, NormalizedInput, ProjectionOp, trace_normalized_input,
)
from geoscale_fx.analysis.forms.site_fields import site_fields
from geoscale_fx.sites.terms import Side, Term

__all__ = ["analyze_mha", "analyze_encoder_layer"]


def analyze_mha(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    """``nn.MultiheadAttention``: found as ``F.multi_head_attention_forward`` (kind ``mha``).

    Returns one term: the query and key rows of ``in_proj_weight`` (or ``q_proj_weight`` /
    ``k_proj_weight`` with ``use_separate_proj_weight``) on each input's normalization; the
    causal flag, masks and dropout read off the call's arguments. Refused when the keys
    include a learned ``bias_k`` / ``static_k`` ("`node`: keys include a learned bias_k /
    static_k that is not a projection of the input"), or when an input is not normalized.
    """
    node = cand.node
    query, key = node.args[0], node.args[1]
    embed_dim, n_heads = int(node.args[3]), int(node.args[4])
    if arg(node, 7, "bias_k") is not None or arg(node, 21, "static_k") is not None:
        raise Unsupported(f"`{node.name}`: keys include a learned bias_k / static_k that is "
                          "not a projection of the input")
    d_h = embed_dim // n_heads
    separate = bool(arg(node, 17, "use_separate_proj_weight", False))
    in_w, in_b = arg(node, 5, "in_proj_weight"), arg(node, 6, "in_proj_bias")
    q_w = arg(node, 18, "q_proj_weight") if separate else in_w
    k_w = arg(node, 19, "k_proj_weight") if separate else in_w
    q_norm = trace_normalized_input(query, kinds, node)
    k_norm = q_norm if key is query else trace_normalized_input(key, kinds, node)
    q_proj = _packed_side(node, q_w, in_b, q_norm, _contiguous_heads(n_heads, d_h, 0))
    k_off = 0 if separate else embed_dim
    k_proj = _packed_side(node, k_w, in_b, k_norm, _contiguous_heads(n_heads, d_h, k_off),
                          bias_offset=embed_dim if separate else 0)
    cand = replace(
        cand, scale=1.0 / math.sqrt(d_h), is_causal=bool(arg(node, 24, "is_causal", False)),
        has_mask=arg(node, 16, "attn_mask") is not None or
        arg(node, 14, "key_padding_mask") is not None,
        dropout_p=float(arg(node, 10, "dropout_p", 0.0)) if arg(node, 13, "training",
                                                                True) else 0.0)
    q_len = (shape_of(query) or (0,))[0]
    kv_len = (shape_of(key) or (0,))[0]
    return site_fields(cand, [Term(q_proj, k_proj)], 1.0, q_len, kv_len,
                       torch.arange(n_heads))


def analyze_encoder_layer(cand: Candidate, kinds: ValueKinds, evaluator, order) -> dict:
    """``nn.TransformerEncoderLayer``'s inference fast path: found as
    ``torch._transformer_encoder_layer_fwd`` (kind ``encoder_layer``: the whole layer is one op).

    Returns one term: the query and key rows of the packed in-projection on the layer's own
    LayerNorm (``norm_first``) or on the normalization of ``src``; masked when a mask is
    passed. Refused only when ``src`` is not normalized (``trace_normalized_input``'s reason).
    """
    node = cand.node
    src, embed_dim, n_heads = node.args[0], int(node.args[1]), int(node.args[2])
    d_h = embed_dim // n_heads
    if node.args[8]:  # norm_first: the layer normalizes src itself (norm1)
        norm = NormalizedInput("layernorm", node, embed_dim,
                               (("mul", node.args[10]), ("add", node.args[11])), 1.0)
    else:
        norm = trace_normalized_input(src, kinds, node)
    w, b = node.args[3], node.args[4]
    q_proj = _packed_side(node, w, b, norm, _contiguous_heads(n_heads, d_h, 0))
    k_proj = _packed_side(node, w, b, norm, _contiguous_heads(n_heads, d_h, embed_dim))
    cand = replace(cand, scale=1.0 / math.sqrt(d_h),
                   has_mask=len(node.args) > 18 and node.args[18] is not None)
    shape = shape_of(src) or (0, 0)
    return site_fields(cand, [Term(q_proj, k_proj)], 1.0, shape[-2], shape[-2],
                       torch.arange(n_heads))


def _contiguous_heads(n: int, d_h: int, offset: int) -> tuple:
    return tuple(tuple(range(offset + h * d_h, offset + (h + 1) * d_h)) for h in range(n))


def _packed_side(node: Node, weight: Node, bias, norm: NormalizedInput, features,
                 bias_offset: int = 0) -> Side:
    """A side read off the op's arguments: ``features`` rows of ``weight`` (and ``bias``)."""
    op = ProjectionOp(node, node, weight, "linear", bias)
    rows = HeadRows(features, torch.arange(len(features)), 1.0, 0.0, False)
    return projection_side(op, rows, source_of(norm), [], bias_offset=bias_offset)
