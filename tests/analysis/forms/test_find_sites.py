"""``find_candidates`` on captured graphs: which softmaxes/SDPA calls are attention sites, and
what is read off them (scale, mask, causal flag, GQA, dropout, key layout, roles)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.forms.candidate import Candidate
from geoscale_fx.analysis.forms.find_sites import find_candidates
from geoscale_fx.analysis.fx.graph_ops import VALUE_CASTS, ValueKinds, op_of

B, L, D, H, DH = 2, 6, 32, 4, 8
S = DH ** -0.5                                        # the usual softmax scale


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

def _inputs(kv_heads: int = H, head_dim: int = DH):
    q = torch.randn(B, H, L, head_dim)
    k = torch.randn(B, kv_heads, L, head_dim)
    v = torch.randn(B, kv_heads, L, head_dim)
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    mask = torch.zeros(L, L).masked_fill(~keep, float("-inf"))
    return q, k, v, mask, keep


def _candidates(fn, *args) -> tuple[list[Candidate], list[Node]]:
    """Candidates of the single graph captured from ``fn(*args)``, and the graph's nodes."""
    (graph,) = capture_graphs(fn, *args)
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    return find_candidates(graph.gm.graph, kinds), list(graph.gm.graph.nodes)


def _source(node) -> str:
    """Name of the placeholder reached by following first tensor arguments upwards."""
    while isinstance(node, Node) and node.op != "placeholder":
        node = next(a for a in node.args if isinstance(a, Node))
    return node.name


def _through_casts_and_dropout(node: Node) -> Node:
    while op_of(node) in VALUE_CASTS or op_of(node) == "dropout":
        node = node.args[0]
    return node


def _kt(k):
    return k.transpose(-2, -1)


# --------------------------------------------------------------------------------------
# SDPA
# --------------------------------------------------------------------------------------

SDPA = {
    # name: (call, inputs kwargs, expected fields)
    "default": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v), {},
                dict(scale=S)),
    "custom_scale": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, scale=0.3),
                     {}, dict(scale=0.3)),
    "causal": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, is_causal=True), {},
               dict(scale=S, is_causal=True)),
    "attn_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), {},
                  dict(scale=S, has_mask=True)),
    "gqa": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            dict(kv_heads=2), dict(scale=S, gqa=True)),
    "dropout": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), {},
                dict(scale=S, dropout_p=0.1)),
    "head_dim_16": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v), dict(
        head_dim=16), dict(scale=0.25)),
}


@pytest.mark.parametrize("name", sorted(SDPA))
def test_sdpa_call_is_one_candidate_with_its_arguments(name):
    """An SDPA call is one "sdpa" candidate: scale (default 1/√d_h), mask, causal flag, GQA,
    dropout, and the query/key operands are read from the call."""
    call, shapes, expected = SDPA[name]
    q, k, v, mask, _keep = _inputs(**shapes)
    (cand,), _ = _candidates(call, q, k, v, mask)
    fields = dict(scale=None, is_causal=False, has_mask=False, gqa=False, dropout_p=0.0)
    fields.update(expected)
    assert cand.kind == "sdpa" and op_of(cand.node) == "sdpa"
    assert cand.scale == pytest.approx(fields.pop("scale"))
    for key, value in fields.items():
        assert getattr(cand, key) == pytest.approx(value), key
    assert _source(cand.query) == "l_q_" and _source(cand.key) == "l_k_"
    assert cand.roles == {"attention": cand.node}


# --------------------------------------------------------------------------------------
# Explicit softmax(c·QKᵀ + mask) @ V in several surface orders
# --------------------------------------------------------------------------------------

def _einsum_blhd(q, k, v, m, keep):
    s = torch.einsum("blhd,bmhd->bhlm", q.transpose(1, 2), k.transpose(1, 2)) * S
    return torch.einsum("bhlm,bmhd->blhd", s.softmax(-1), v.transpose(1, 2))


def _bmm(q, k, v, m, keep):
    qb, kb, vb = (t.reshape(B * H, L, DH) for t in (q, k, v))
    s = torch.bmm(qb, kb.transpose(1, 2)) / math.sqrt(DH)
    return torch.bmm(F.softmax(s, dim=-1), vb)


def _baddbmm(q, k, v, m, keep):
    qb, kb, vb = (t.reshape(B * H, L, DH) for t in (q, k, v))
    s = torch.baddbmm(m.expand(B * H, L, L), qb, kb.transpose(1, 2), alpha=0.125)
    return torch.bmm(s.softmax(dim=-1), vb)


EXPLICIT = {
    # name: (fn, scale, has_mask, key_layout, scores op, dropout_p)
    "div_no_mask": (lambda q, k, v, m, keep: F.softmax(q @ _kt(k) / math.sqrt(DH), dim=-1) @ v,
                    S, False, "dk", "matmul", 0.0),
    "mul_then_mask": (lambda q, k, v, m, keep: torch.softmax(q @ _kt(k) * S + m, -1) @ v,
                      S, True, "dk", "matmul", 0.0),
    "mask_then_div": (lambda q, k, v, m, keep: ((q @ _kt(k) + m) / math.sqrt(DH))
                      .softmax(-1) @ v, S, True, "dk", "matmul", 0.0),
    "mask_first_const_first": (lambda q, k, v, m, keep: torch.matmul(
        F.softmax(m + 0.25 * torch.matmul(q, _kt(k)), dim=-1), v), 0.25, True, "dk", "matmul",
        0.0),
    "masked_fill": (lambda q, k, v, m, keep: (q @ _kt(k) * S).masked_fill(
        ~keep, float("-inf")).softmax(-1) @ v, S, True, "dk", "matmul", 0.0),
    "where": (lambda q, k, v, m, keep: torch.where(keep, q @ _kt(k) * S, float("-inf"))
              .softmax(-1) @ v, S, True, "dk", "matmul", 0.0),
    "sub_mask": (lambda q, k, v, m, keep: (q @ _kt(k) - 1e4 * (~keep).float()).softmax(-1) @ v,
                 1.0, True, "dk", "matmul", 0.0),
    "two_factors_and_casts": (lambda q, k, v, m, keep: F.softmax(
        (q.float() @ _kt(k).float()).mul(0.5) / 4, dim=-1, dtype=torch.float32).to(v.dtype) @ v,
        0.125, False, "dk", "matmul", 0.0),
    "einsum": (lambda q, k, v, m, keep: torch.einsum(
        "bhlm,bhmd->bhld", (torch.einsum("bhld,bhmd->bhlm", q, k) * S).softmax(-1), v),
        S, False, "kd", "einsum", 0.0),
    "einsum_blhd": (_einsum_blhd, S, False, "kd", "einsum", 0.0),
    "bmm_merged_heads": (_bmm, S, False, "dk", "bmm", 0.0),
    "baddbmm_mask_alpha": (_baddbmm, 0.125, True, "dk", "baddbmm", 0.0),
    "dropout_training": (lambda q, k, v, m, keep: F.dropout(
        (q @ _kt(k) * S).softmax(-1), p=0.1, training=True) @ v, S, False, "dk", "matmul", 0.1),
    "dropout_eval": (lambda q, k, v, m, keep: F.dropout(
        (q @ _kt(k) * S).softmax(-1), p=0.1, training=False) @ v, S, False, "dk", "matmul", 0.0),
}


@pytest.mark.parametrize("name", sorted(EXPLICIT))
def test_explicit_attention_forms(name):
    """softmax(c·QKᵀ [+mask]) @ V in any surface order is one "explicit" candidate with the
    product of scalar factors as scale, the mask flag, the key layout, dropout, and roles
    pointing at the QKᵀ product, the softmax and the product with V."""
    fn, scale, has_mask, key_layout, scores_op, dropout_p = EXPLICIT[name]
    (cand,), _ = _candidates(fn, *_inputs())
    assert cand.kind == "explicit" and op_of(cand.node) == "softmax"
    assert cand.scale == pytest.approx(scale)
    assert cand.has_mask is has_mask
    assert cand.key_layout == key_layout
    assert cand.dropout_p == pytest.approx(dropout_p)
    assert not cand.is_causal and not cand.gqa
    assert _source(cand.query) == "l_q_" and _source(cand.key) == "l_k_"
    roles = cand.roles
    assert {"scores", "softmax", "pv"} <= set(roles)
    assert roles["softmax"] is cand.node
    assert op_of(roles["scores"]) == scores_op
    pv = roles["pv"]
    probs, values = (pv.args[1], pv.args[2]) if op_of(pv) == "einsum" else pv.args[:2]
    assert _through_casts_and_dropout(probs) is cand.node
    assert _source(values) == "l_v_"


ZEROED = {
    # CPM-Ant: the masked probabilities zeroed again after the softmax
    "masked_fill_zero": lambda p, keep: p.masked_fill(~keep, torch.scalar_tensor(0.0)),
    "where_zero": lambda p, keep: torch.where(keep, p, 0.0),
    "where_zero_first": lambda p, keep: torch.where(~keep, 0.0, p),
}


@pytest.mark.parametrize("name", sorted(ZEROED))
def test_probabilities_zeroed_after_the_softmax_still_multiply_values(name):
    """``masked_fill(P, m, 0)`` / ``where(m, P, 0)`` keeps every probability in [0, 1]: the
    path to ``@ V`` goes through it."""
    zero = ZEROED[name]
    fn = lambda q, k, v, m, keep: zero((q @ _kt(k) * S).masked_fill(
        ~keep, float("-inf")).softmax(-1), keep) @ v
    (cand,), _ = _candidates(fn, *_inputs())
    assert not cand.failure and op_of(cand.roles["pv"]) == "matmul"
    assert _source(cand.roles["pv"].args[1]) == "l_v_"


def test_probabilities_filled_with_a_nonzero_value_are_not_followed():
    """Filling masked probabilities with 0.5 is not a zeroing: the site is reported."""
    fn = lambda q, k, v, m, keep: (q @ _kt(k) * S).softmax(-1).masked_fill(~keep, 0.5) @ v
    (cand,), _ = _candidates(fn, *_inputs())
    assert cand.failure is not None and "never multiply values" in cand.failure


@pytest.mark.parametrize("name, query_perm, key_perm", [
    ("einsum", (0, 1, 2, 3), (0, 1, 2, 3)),
    ("einsum_blhd", (0, 2, 1, 3), (0, 2, 1, 3)),
])
def test_einsum_operand_permutations(name, query_perm, key_perm):
    """For einsum scores, query_perm/key_perm bring each operand to (batch…, L, D)."""
    (cand,), _ = _candidates(EXPLICIT[name][0], *_inputs())
    assert cand.query_perm == query_perm
    assert cand.key_perm == key_perm
    q, k = cand.roles["scores"].args[1:3]
    assert (cand.query, cand.key) == (q, k)


@pytest.mark.parametrize("name", ["div_no_mask", "bmm_merged_heads", "baddbmm_mask_alpha"])
def test_matmul_forms_have_no_permutation(name):
    """matmul/bmm/baddbmm scores take the key as (…, D, L') and leave the perms unset."""
    (cand,), _ = _candidates(EXPLICIT[name][0], *_inputs())
    assert cand.query_perm is None and cand.key_perm is None
    assert op_of(cand.key) == "transpose"


# --------------------------------------------------------------------------------------
# Softmaxes that are not attention, and counts in mixed graphs
# --------------------------------------------------------------------------------------

class Classifier(nn.Module):
    """softmax(x W) @ P with parameters W, P: class probabilities, not attention."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, 10))
        self.proto = nn.Parameter(torch.randn(10, D))
        self.head = nn.Linear(D, 10)

    def forward(self, x):
        a = F.softmax(x @ self.w, dim=-1) @ self.proto
        b = F.softmax(self.head(x), dim=-1) @ self.proto
        return a + b


NOT_ATTENTION = {
    "softmax_over_keys_dim": lambda q, k, v, m, keep: F.softmax(q @ _kt(k) * S, dim=-2) @ v,
    "softmax_over_heads_dim": lambda q, k, v, m, keep: F.softmax(q @ _kt(k) * S, dim=1) @ v,
    "probabilities_not_multiplied": lambda q, k, v, m, keep: F.softmax(q @ _kt(k) * S, -1),
    "probabilities_on_the_right": lambda q, k, v, m, keep: _kt(v) @ F.softmax(q @ _kt(k), -1),
    "nonlinearity_on_scores": lambda q, k, v, m, keep: F.softmax(torch.relu(q @ _kt(k)), -1) @ v,
    # a product of the scores with an activation (a gate from the input), unlike a mask
    # buffer (``multiplied_mask`` in tests/attention_variants.py), is not a score modifier
    "scores_times_an_activation": lambda q, k, v, m, keep: F.softmax(
        q @ _kt(k) * torch.sigmoid(q.sum(-1, keepdim=True)), -1) @ v,
}


@pytest.mark.parametrize("name", sorted(NOT_ATTENTION))
def test_softmax_over_qk_outside_the_normal_form_is_reported_not_silent(name):
    """Softmax over a non-last dim, unused probabilities, probabilities as the right operand,
    or a nonlinearity on the scores: not the normal form, but a softmax over a product of two
    activations, so it is a candidate whose ``failure`` names the softmax and the product."""
    cands, nodes = _candidates(NOT_ATTENTION[name], *_inputs())
    assert any(op_of(n) == "softmax" for n in nodes)
    cand, = cands
    assert cand.kind == "explicit" and op_of(cand.node) == "softmax"
    assert cand.failure.startswith(f"`{cand.node.name}` is a softmax over `")
    assert "product of two activations" in cand.failure


def test_softmax_classifier_with_parameter_weights_is_not_found():
    """softmax(x @ W) @ P and softmax(linear(x)) @ P (W, P parameters) are not attention."""
    cands, nodes = _candidates(Classifier(), torch.randn(B, L, D))
    assert sum(op_of(n) == "softmax" for n in nodes) == 2
    assert cands == []


class Mixed(nn.Module):
    """Two attentions (SDPA, then explicit) and two non-attention softmaxes in one graph."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.classifier = Classifier()

    def _heads(self, x):
        q, k, v = self.qkv(self.norm(x)).split(D, dim=-1)
        return tuple(t.view(B, L, H, DH).transpose(1, 2) for t in (q, k, v))

    def forward(self, x):
        q, k, v = self._heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(B, L, D)
        q, k, v = self._heads(x)
        s = F.softmax(q @ _kt(k) / math.sqrt(DH), dim=-1)
        x = x + (s @ v).transpose(1, 2).reshape(B, L, D)
        side = F.softmax(q @ _kt(k), dim=-2).sum()
        return self.classifier(x) + side


def test_mixed_graph_has_exactly_the_two_attentions_in_order():
    """A graph with SDPA, an explicit attention, a non-last-dim softmax and a classifier
    yields exactly two candidates, in graph order."""
    cands, nodes = _candidates(Mixed(), torch.randn(B, L, D))
    assert sum(op_of(n) == "softmax" for n in nodes) == 4
    # the non-last-dim softmax over q·kᵀ is reported (failure set), the classifier is not
    assert [(c.kind, bool(c.failure)) for c in cands] == [("sdpa", False), ("explicit", False),
                                                          ("explicit", True)]
    sdpa, explicit, _ = cands
    assert sdpa.is_causal and not sdpa.has_mask
    assert explicit.scale == pytest.approx(S) and explicit.key_layout == "dk"
    assert nodes.index(sdpa.node) < nodes.index(explicit.node)


def test_two_attentions_in_one_function_are_two_candidates():
    """Every attention of a graph is found, each with its own scale."""
    def two(q, k, v, m, keep):
        a = F.softmax(q @ _kt(k) * 0.5, dim=-1) @ v
        return F.scaled_dot_product_attention(a, k, v, scale=0.2) + \
            F.softmax(a @ _kt(k) + m, dim=-1) @ v

    cands, _ = _candidates(two, *_inputs())
    assert [(c.kind, round(c.scale, 6), c.has_mask) for c in cands] == [
        ("explicit", 0.5, False), ("sdpa", 0.2, False), ("explicit", 1.0, True)]


@pytest.mark.parametrize("grad", [True, False], ids=["mha", "encoder_layer"])
def test_opaque_attention_modules_are_single_candidates(grad):
    """nn.TransformerEncoderLayer is one "mha" candidate with autograd on, one
    "encoder_layer" candidate (the fused inference fast path) under no_grad in eval."""
    layer = nn.TransformerEncoderLayer(D, H, 2 * D, batch_first=True, norm_first=True).eval()
    with torch.set_grad_enabled(grad):
        cands, _ = _candidates(layer, torch.randn(B, L, D))
    (cand,) = cands
    assert cand.kind == ("mha" if grad else "encoder_layer")
    assert cand.roles == {"attention": cand.node}
