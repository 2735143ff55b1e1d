"""Find attention sites in a torch-level FX graph.

Four forms are recognised:

* ``sdpa``: ``F.scaled_dot_product_attention`` (mask, causal flag, scale, GQA, dropout);
* ``explicit``: the normal form ``softmax(M(c · (Q Kᵀ))) [dropout] @ V``, found from each
  softmax by walking *use-def chains* (casts, scalar ``mul``/``div``, and the score modifiers
  ``M`` that the kinds of ``analysis.modifiers`` recognise: masks, position biases,
  softcapping ``c·tanh(S/c)``, sinks) back to a ``matmul``/``bmm``/``baddbmm``/``einsum`` of
  two activations, and forward to the product with ``V``. Any order of those ops is
  accepted; no surface pattern is listed. The modifiers are recorded in graph order (their
  drafts, ``analysis.modifiers.draft``), and the node whose value the softmax's input is
  made of (the scores, or the softcap's output) is the ``logits`` role;
* ``mha``: ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``; Dynamo keeps it opaque);
* ``encoder_layer``: ``torch._transformer_encoder_layer_fwd`` (``nn.TransformerEncoderLayer``'s
  inference fast path: the whole layer is one op).

A softmax that does not fit the normal form is not an attention and is skipped.
"""
from __future__ import annotations

import math
from typing import Optional

from torch.fx import Graph, Node

from geoscale_fx.analysis.forms.candidate import Candidate, CandidateDraft
from geoscale_fx.analysis.fx.graph_ops import (
    VALUE_CASTS, ValueKinds, arg, matmul_operands, op_of, scalar_constant, shape_of, static_bool,
)
from geoscale_fx.analysis.modifiers.draft import Route
from geoscale_fx.analysis.modifiers.registry import product_routes, routes_through
from geoscale_fx.analysis.sides.score_operands import set_operands

__all__ = ["find_candidates"]

_MATMULS = ("matmul", "bmm", "baddbmm", "einsum")


def find_candidates(graph: Graph, kinds: ValueKinds) -> list[Candidate]:
    found = []
    for node in graph.nodes:
        op = op_of(node)
        if op == "sdpa":
            found.append(_sdpa(node, kinds))
        elif op == "softmax":
            cand = _explicit(node, kinds)
            if cand is not None:
                found.append(cand)
        elif op == "mha":
            found.append(Candidate("mha", node, roles={"attention": node}))
        elif op == "encoder_layer":
            found.append(Candidate("encoder_layer", node, roles={"attention": node}))
    return found


def _sdpa(node: Node, kinds: ValueKinds) -> Candidate:
    q, k = node.args[0], node.args[1]
    mask = arg(node, 3, "attn_mask")
    scale = arg(node, 6, "scale")
    scale = (1.0 / math.sqrt((shape_of(q) or (1,))[-1]) if scale is None
             else scalar_constant(scale))
    dropout = scalar_constant(arg(node, 4, "dropout_p", 0.0))
    is_causal = static_bool(arg(node, 5, "is_causal", False))
    return Candidate("sdpa", node, query=q, key=k, scale=scale if scale is not None else
                     float("nan"), is_causal=is_causal, has_mask=mask is not None,
                     dropout_p=dropout or 0.0, gqa=static_bool(arg(node, 7, "enable_gqa", False)),
                     roles={"attention": node},
                     modifiers=[route.draft for route in product_routes(node, kinds)])


def _softmax_dim_is_last(node: Node) -> bool:
    dim = arg(node, 1, "dim")
    ndim = len(shape_of(node) or ())
    return dim in (-1, ndim - 1)


def _explicit(softmax: Node, kinds: ValueKinds) -> Optional[Candidate]:
    """The explicit normal form from a softmax; a softmax over a product of two activations
    that does not fit it is a candidate too, with ``failure`` saying why (never silent)."""
    product = _product_of_activations(softmax.args[0], kinds)
    if product is None:
        return None          # not attention: no QKᵀ behind this softmax
    cand = CandidateDraft("explicit", softmax)
    if not _softmax_dim_is_last(softmax):
        return _failed(cand, product, "the softmax is not over the last dim of the scores")
    scores = _walk_scores(softmax.args[0], kinds, cand, depth=0)
    if scores is None:
        blocker = cand.roles.get("blocker")
        where = f" through `{blocker.name}` ({op_of(blocker) or blocker.target})" if blocker \
            else ""
        return _failed(cand, product, f"the softmax reads it{where}, which is not a scalar "
                                      "scale, mask, position bias, softcap or sink")
    pv = _product_with_values(softmax, cand)
    if pv is None:
        return _failed(cand, product, "its probabilities never multiply values")
    if not set_operands(scores, cand):
        return _failed(cand, product, f"the einsum `{scores.args[0]}` is not q·kᵀ")
    cand.roles.pop("blocker", None)
    cand.roles.update({"scores": scores, "softmax": softmax, "pv": pv})
    cand.roles.setdefault("logits", scores)
    return cand.freeze()


def _failed(cand: CandidateDraft, product: Node, why: str) -> Candidate:
    cand.roles = {"softmax": cand.node, "scores": product}
    cand.failure = (f"`{cand.node.name}` is a softmax over `{product.name}`, a product of two "
                    f"activations, but {why}; left in high precision")
    return cand.freeze()


#: where the search for a QKᵀ behind a softmax stops: projections, normalizations and whole
#: attentions start a new computation (a router's softmax over linear(x) is not attention)
_BARRIERS = frozenset({"linear", "addmm", "layer_norm", "rms_norm", "sdpa", "mha",
                       "encoder_layer"})


def _product_of_activations(node, kinds: ValueKinds, depth: int = 12) -> Optional[Node]:
    """The nearest matmul/bmm/baddbmm/einsum of two activations behind ``node`` (through
    elementwise and data-movement ops only), or None."""
    stack, seen = [(node, 0)], set()
    while stack:
        node, d = stack.pop()
        if not isinstance(node, Node) or node in seen or d > depth:
            continue
        seen.add(node)
        op = op_of(node)
        if op in _MATMULS:
            operands = matmul_operands(node)
            if sum(isinstance(a, Node) and kinds.is_activation(a) for a in operands) == 2:
                return node
            continue      # a product with a weight: a projection
        if op in _BARRIERS or node.op == "call_module":
            continue
        stack.extend((n, d + 1) for n in node.all_input_nodes if kinds.is_activation(n))
    return None


def _walk_scores(node, kinds: ValueKinds, cand: CandidateDraft, depth: int) -> Optional[Node]:
    """Back from the softmax input to ``Q Kᵀ``; records scalar scales and the score modifiers
    (``analysis.modifiers``) in ``cand``."""
    if not isinstance(node, Node) or depth > 16:
        return None
    op = op_of(node)
    if op in _MATMULS:
        operands = matmul_operands(node)
        if op == "einsum" and (len(node.args) != 3 or not isinstance(node.args[0], str)):
            return None
        if all(isinstance(a, Node) and kinds.is_activation(a) for a in operands):
            fused = product_routes(node, kinds)          # baddbmm: β·bias + α·QKᵀ
            for route in fused:
                cand.scale *= route.factor
                cand.has_mask = cand.has_mask or route.masks
            cand.modifiers[:0] = [route.draft for route in fused]
            return node
        cand.roles.setdefault("blocker", node)
        return None
    if op in VALUE_CASTS or _keeps_score_dims(node):
        return _walk_scores(node.args[0], kinds, cand, depth + 1)
    routes = routes_through(node, kinds)
    if routes is not None:
        return _through(node, routes, kinds, cand, depth)
    if op in ("mul", "div"):
        a, b = node.args[0], node.args[1]
        for x, c in ((a, b), (b, a)) if op == "mul" else ((a, b),):
            value = scalar_constant(c)
            if value is not None and value != 0:
                cand.scale *= value if op == "mul" else 1.0 / value
                return _walk_scores(x, kinds, cand, depth + 1)
        return None
    cand.roles.setdefault("blocker", node)
    return None


def _through(node: Node, routes: list[Route], kinds: ValueKinds, cand: CandidateDraft,
             depth: int) -> Optional[Node]:
    """Through a score modifier: the first route whose operand leads to ``Q Kᵀ``; its draft
    is recorded after the modifiers below it (graph order)."""
    for route in routes:
        trial = CandidateDraft("explicit", cand.node, scale=1.0 if route.logits else cand.scale)
        found = _walk_scores(route.operand, kinds, trial, depth + 1)
        if found is None:
            if route.names_blocker and "blocker" in trial.roles:
                cand.roles.setdefault("blocker", trial.roles["blocker"])
            continue
        cand.scale = trial.scale * route.factor
        cand.has_mask = cand.has_mask or trial.has_mask or route.masks
        cand.modifiers[:0] = trial.modifiers + [route.draft]
        cand.roles.update(trial.roles)
        if route.logits:
            cand.roles["logits"] = node
        return found
    return None


def _keeps_score_dims(node: Node) -> bool:
    """A view/reshape that only regroups the leading (batch, head) dims of the scores."""
    if op_of(node) not in ("view", "reshape") or not isinstance(node.args[0], Node):
        return False
    before, after = shape_of(node.args[0]), shape_of(node)
    return before is not None and after is not None and len(before) >= 2 and \
        len(after) >= 2 and tuple(before[-2:]) == tuple(after[-2:])


def _product_with_values(softmax: Node, cand: CandidateDraft) -> Optional[Node]:
    """Follow the probabilities (casts, dropout) to the matmul where they are the left operand."""
    frontier = [softmax]
    for _ in range(8):
        nxt = []
        for node in frontier:
            for user in node.users:
                op = op_of(user)
                if op in ("matmul", "bmm") and user.args[0] is node:
                    return user
                if op == "einsum" and len(user.args) == 3 and user.args[1] is node:
                    return user
                if op in VALUE_CASTS or op == "getitem" or _keeps_score_dims(user) or \
                        _zeroes_probabilities(user, node):
                    nxt.append(user)          # casts, a sink column sliced off, (B·H) views
                elif op == "dropout":
                    cand.dropout_p = float(arg(user, 1, "p", 0.5)) if arg(
                        user, 2, "training", True) else 0.0
                    nxt.append(user)
        frontier = nxt
    return None


def _zeroes_probabilities(user: Node, probs: Node) -> bool:
    """``masked_fill(P, m, 0)`` / ``where(m, 0, P)`` / ``where(m, P, 0)`` after the softmax
    (CPM-Ant re-zeroes masked rows): entries become 0, so every probability stays in [0, 1]
    and the logits' scale is unchanged."""
    op = op_of(user)
    if op == "masked_fill":
        return user.args[0] is probs and scalar_constant(arg(user, 2, "value")) == 0
    if op == "where" and len(user.args) == 3:
        a, b = user.args[1], user.args[2]
        return (a is probs and scalar_constant(b) == 0) or (b is probs and
                                                            scalar_constant(a) == 0)
    return False
