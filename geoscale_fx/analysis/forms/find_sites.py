"""Find attention sites in a torch-level FX graph.

Four forms are recognised:

* ``sdpa``: ``F.scaled_dot_product_attention`` (mask, causal flag, scale, GQA, dropout);
* ``explicit``: the normal form ``softmax(M(c · (Q Kᵀ))) [dropout] @ V``, found from each
  softmax by walking *use-def chains* (casts, scalar ``mul``/``div``, and the score modifiers
  ``M``: additive / ``masked_fill`` / ``where`` masks, softcapping ``c·tanh(S/c)``) back to a
  ``matmul``/``bmm``/``baddbmm``/``einsum`` of two activations, and forward to the product with
  ``V``. Any order of those ops is accepted; no surface pattern is listed. The modifiers are
  recorded in graph order, and the node whose value the softmax's input is made of (the
  scores, or the softcap's output) is the ``logits`` role;
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
    DATA_MOVEMENT, VALUE_CASTS, ValueKinds, arg, baddbmm_args, matmul_operands, op_of,
    scalar_constant, shape_of, static_bool,
)
from geoscale_fx.analysis.sides.score_operands import set_operands

__all__ = ["find_candidates"]

_MATMULS = ("matmul", "bmm", "baddbmm", "einsum")


def find_candidates(graph: Graph, kinds: ValueKinds) -> list[Candidate]:
    found = []
    for node in graph.nodes:
        op = op_of(node)
        if op == "sdpa":
            found.append(_sdpa(node))
        elif op == "softmax":
            cand = _explicit(node, kinds)
            if cand is not None:
                found.append(cand)
        elif op == "mha":
            found.append(Candidate("mha", node, roles={"attention": node}))
        elif op == "encoder_layer":
            found.append(Candidate("encoder_layer", node, roles={"attention": node}))
    return found


def _sdpa(node: Node) -> Candidate:
    q, k = node.args[0], node.args[1]
    mask = arg(node, 3, "attn_mask")
    scale = arg(node, 6, "scale")
    scale = (1.0 / math.sqrt((shape_of(q) or (1,))[-1]) if scale is None
             else scalar_constant(scale))
    dropout = scalar_constant(arg(node, 4, "dropout_p", 0.0))
    is_causal = static_bool(arg(node, 5, "is_causal", False))
    masked = mask is not None or is_causal
    return Candidate("sdpa", node, query=q, key=k, scale=scale if scale is not None else
                     float("nan"), is_causal=is_causal, has_mask=mask is not None,
                     dropout_p=dropout or 0.0, gqa=static_bool(arg(node, 7, "enable_gqa", False)),
                     roles={"attention": node},
                     modifiers=[("mask", node, float("nan"))] if masked else [])


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
    """Back from the softmax input to ``Q Kᵀ``; records scalar scale and masks in ``cand``."""
    if not isinstance(node, Node) or depth > 16:
        return None
    op = op_of(node)
    if op in _MATMULS:
        operands = matmul_operands(node)
        if op == "einsum" and (len(node.args) != 3 or not isinstance(node.args[0], str)):
            return None
        if all(isinstance(a, Node) and kinds.is_activation(a) for a in operands):
            if op == "baddbmm":   # β·bias + α·QKᵀ: the bias is an additive position bias
                _, _, _, beta, alpha = baddbmm_args(node)
                cand.scale *= alpha
                cand.has_mask = True
                cand.modifiers.insert(0, ("position_bias", node, beta))
            return node
        cand.roles.setdefault("blocker", node)
        return None
    if op in VALUE_CASTS or _keeps_score_dims(node):
        return _walk_scores(node.args[0], kinds, cand, depth + 1)
    softcap = _softcap(node)
    if softcap is not None:
        return _through_softcap(node, *softcap, kinds, cand, depth)
    if op in ("mul", "div"):
        a, b = node.args[0], node.args[1]
        for x, c in ((a, b), (b, a)) if op == "mul" else ((a, b),):
            value = scalar_constant(c)
            if value is not None and value != 0:
                cand.scale *= value if op == "mul" else 1.0 / value
                return _walk_scores(x, kinds, cand, depth + 1)
        if op == "mul":
            # ``S · b`` with a tensor no input flows into (GPT-1's 0/1 causal buffer): a
            # multiplicative mask, applied after the quantized scores as an additive one is
            for x, c in ((a, b), (b, a)):
                if isinstance(c, Node) and not kinds.is_activation(c):
                    return _through_mask(node, (x,), kinds, cand, depth)
        return None
    if op == "add":
        return _through_mask(node, node.args[:2], kinds, cand, depth)
    if op == "sub":
        return _through_mask(node, node.args[:1], kinds, cand, depth)
    if op == "masked_fill":
        return _through_mask(node, node.args[:1], kinds, cand, depth)
    if op == "cat":
        return _through_sink(node, kinds, cand, depth)
    if op == "where":
        return _through_mask(node, node.args[1:3], kinds, cand, depth)
    if op in ("max", "maximum") and len(node.args) == 2 and _not_activation(node.args[1],
                                                                          kinds):
        # ``max(S + M, finfo.min)`` (XGLM): a floor on the masked scores, after them
        return _through_mask(node, node.args[:1], kinds, cand, depth)
    cand.roles.setdefault("blocker", node)
    return None


def _not_activation(value, kinds: ValueKinds) -> bool:
    """A float, or a tensor that no input of the model flows into (a constant floor; an int
    would be ``torch.max(S, dim)``, a reduction)."""
    return isinstance(value, float) or (isinstance(value, Node) and
                                        not kinds.is_activation(value))


def _keeps_score_dims(node: Node) -> bool:
    """A view/reshape that only regroups the leading (batch, head) dims of the scores."""
    if op_of(node) not in ("view", "reshape") or not isinstance(node.args[0], Node):
        return False
    before, after = shape_of(node.args[0]), shape_of(node)
    return before is not None and after is not None and len(before) >= 2 and \
        len(after) >= 2 and tuple(before[-2:]) == tuple(after[-2:])


def _through_sink(node: Node, kinds: ValueKinds, cand: CandidateDraft, depth: int
                  ) -> Optional[Node]:
    """Attention sinks: ``cat([S, sink], -1)`` with a parameter-only ``sink`` column, or one
    logit per query computed from the activations (width 1: the analysis bounds it, or
    refuses the site naming it, ``analysis.sides.sink_bound``)."""
    parts, dim = arg(node, 0, "tensors"), arg(node, 1, "dim", 0)
    if dim not in (-1, len(shape_of(node) or ()) - 1) or len(parts) != 2:
        return None
    scores, sink = parts
    if not isinstance(sink, Node):
        return None
    if kinds.is_param(sink):
        sink = _value_source(sink)  # the sinks parameter itself (max|·| is unchanged by views)
    elif not (kinds.is_activation(sink) and (shape_of(sink) or (0,))[-1] == 1):
        sink = None
    if sink is None:
        cand.roles.setdefault("blocker", node)
        return None
    trial = CandidateDraft("explicit", cand.node, scale=cand.scale)
    found = _walk_scores(scores, kinds, trial, depth + 1)
    if found is None:
        return None
    cand.scale, cand.has_mask = trial.scale, cand.has_mask or trial.has_mask
    cand.modifiers[:0] = trial.modifiers + [("sink", sink, float("nan"))]
    cand.roles.update(trial.roles)
    return found


def _value_source(node: Node) -> Optional[Node]:
    """The placeholder behind ``node`` through views and casts only (same values), or None."""
    for _ in range(16):
        if node.op == "placeholder":
            return node
        if op_of(node) not in DATA_MOVEMENT and op_of(node) not in VALUE_CASTS:
            return None
        node = node.args[0] if isinstance(node.args[0], Node) else None
        if node is None:
            return None
    return None


def _softcap(node: Node) -> Optional[tuple[Node, float]]:
    """``(tanh input, c)`` if ``node`` is ``c · tanh(y)`` (up to casts), else None."""
    if op_of(node) != "mul":
        return None
    for t, c in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        value = scalar_constant(c)
        while isinstance(t, Node) and op_of(t) in VALUE_CASTS:
            t = t.args[0]
        if value is not None and value != 0 and isinstance(t, Node) and op_of(t) == "tanh":
            return t.args[0], value
    return None


def _through_softcap(node: Node, inner: Node, cap: float, kinds: ValueKinds, cand: CandidateDraft,
                     depth: int) -> Optional[Node]:
    """Softcapping ``c·tanh(y)``: walk ``y = s·QKᵀ/c``; S's own scale is ``s = scale(y)·c``.

    Factors between the softcap and the softmax do not change what must be quantized (the
    softcap's output, bounded by ``c``), so the scale restarts below it.
    """
    trial = CandidateDraft("explicit", cand.node)
    found = _walk_scores(inner, kinds, trial, depth + 1)
    if found is None:
        return None
    cand.scale = trial.scale * cap
    cand.has_mask = cand.has_mask or trial.has_mask
    cand.modifiers[:0] = trial.modifiers + [("softcap", node, abs(cap))]
    cand.roles.setdefault("logits", node)
    return found


def _through_mask(node: Node, operands, kinds: ValueKinds, cand: CandidateDraft, depth: int
                  ) -> Optional[Node]:
    """The operand of a mask op (add, sub, where, masked_fill) that leads to ``Q Kᵀ``; the
    rest is mask."""
    for x in operands:
        trial = CandidateDraft("explicit", cand.node, scale=cand.scale)
        found = _walk_scores(x, kinds, trial, depth + 1)
        if found is None and "blocker" in trial.roles:
            cand.roles.setdefault("blocker", trial.roles["blocker"])
        if found is not None:
            cand.scale, cand.has_mask = trial.scale, True
            added = [o for o in operands if o is not x]
            kind, value = ("position_bias", -1.0 if op_of(node) == "sub" else 1.0) \
                if op_of(node) in ("add", "sub") and any(_reads_parameters(o, kinds)
                                                         for o in added) \
                else ("mask", float("nan"))
            cand.modifiers[:0] = trial.modifiers + [(kind, node, value)]
            cand.roles.update(trial.roles)
            return found
    return None


def _reads_parameters(node, kinds: ValueKinds, depth: int = 24) -> bool:
    """Whether a term added to the scores is computed from parameters (a learned position
    bias: MPNet's bucketed table, DeBERTa's content-to-position and position-to-content
    terms), not only from the inputs and constants (an attention mask)."""
    stack, seen = [(node, 0)], set()
    while stack:
        node, d = stack.pop()
        if not isinstance(node, Node) or node in seen or d > depth:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr") and kinds.is_param(node):
            return True
        stack.extend((n, d + 1) for n in node.all_input_nodes)
    return False


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
