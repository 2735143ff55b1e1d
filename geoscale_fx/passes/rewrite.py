"""The rewrite: replace each planned attention with a program that scales its logits to FP8.

For an SDPA site the call is replaced by ``program(q, k, v, attn_mask, *weights, *state)``
(fused flex_attention or explicit attention, ``geoscale_fx.attention``). For a model's own
explicit attention the scores ``q @ kᵀ`` are routed through ``program(scores, *weights,
*state)``, which quantizes them in place of the original and leaves the model's mask, softmax
and ``· V`` as they were. ``weights`` are the graph's own parameter nodes (placeholders under
Dynamo), so the scale follows the weights every step; ``state`` are new placeholders appended
to the graph. Sites without a plan are not touched.
"""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch.fx import GraphModule, Node

from geoscale_fx import scaling
from geoscale_fx.attention import explicit_attention, fused_attention
from geoscale_fx.fp8 import fake_quantize_logits
from geoscale_fx.passes.graph_ops import arg, scalar_constant, static_bool

__all__ = ["make_program", "rewrite"]


def _per_scale_amax(plan: scaling.SitePlan, logits: torch.Tensor) -> torch.Tensor:
    """max|S| per head (``(H,)``, heads on dim -3) or per layer (``(1,)``)."""
    a = logits.detach().abs()
    if plan.n_scale == 1:
        return a.amax().reshape(1)
    return a.amax(dim=(-2, -1)).reshape(-1, plan.n_scale).amax(dim=0)


def _sdpa_program(plan: scaling.SitePlan, state_names: Sequence[str],
                  call: dict) -> Callable:
    opt, n_w = plan.options, len(plan.weight_names)
    quantize = opt.scaling != "none"

    def program(q, k, v, attn_mask, *rest):
        weights = dict(zip(plan.weight_names, rest[:n_w]))
        state = dict(zip(state_names, rest[n_w:]))
        divisor = scaling.predict_divisor(plan, weights, state) if quantize else None
        if plan.lowering == "fused":  # flex_attention has no dropout (never planned with it)
            fused_call = {k_: v_ for k_, v_ in call.items() if k_ != "dropout_p"}
            out = fused_attention(q, k, v, attn_mask, divisor, fmt=opt.fp8_format, **fused_call)
        else:
            def divisor_of(logits):
                if not quantize:
                    return None
                amax = _per_scale_amax(plan, logits)
                d = scaling.current_divisor(plan, amax) if opt.scaling == "current" else divisor
                scaling.observe(plan, amax, d, state)
                return d
            out = explicit_attention(q, k, v, attn_mask, fmt=opt.fp8_format,
                                     divisor_of=divisor_of, **call)
        scaling.finish_step(state)
        return out.to(q.dtype)
    return program


def _inplace_program(plan: scaling.SitePlan, state_names: Sequence[str]) -> Callable:
    opt, site, n_w = plan.options, plan.site, len(plan.weight_names)
    quantize = opt.scaling != "none"
    lead = site.score_lead

    def program(scores, *rest):
        weights = dict(zip(plan.weight_names, rest[:n_w]))
        state = dict(zip(state_names, rest[n_w:]))
        if not quantize:
            scaling.finish_step(state)
            return scores
        divisor = scaling.predict_divisor(plan, weights, state)
        logits = scores.float() * site.score_scale
        head_index = torch.tensor(site.score_heads, device=scores.device)
        lead_amax = logits.detach().abs().amax(dim=(-2, -1)).reshape(-1)
        if plan.n_scale == 1:
            amax = lead_amax.amax().reshape(1)
        else:
            amax = torch.zeros(plan.n_scale, device=scores.device).scatter_reduce(
                0, head_index, lead_amax, reduce="amax")
        if opt.scaling == "current":
            divisor = scaling.current_divisor(plan, amax)
        scaling.observe(plan, amax, divisor, state)
        per_lead = divisor.index_select(0, head_index) if plan.n_scale > 1 else \
            divisor.expand(head_index.numel())
        quantized = fake_quantize_logits(logits, per_lead.reshape(*lead, 1, 1), opt.fp8_format)
        scaling.finish_step(state)
        return (quantized / site.score_scale).to(scores.dtype)
    return program


def make_program(plan: scaling.SitePlan, state_names: Sequence[str],
                 sdpa_call: dict | None = None) -> Callable:
    """The function a rewritten node calls (named after the site for readable graphs)."""
    if plan.lowering == "inplace":
        program = _inplace_program(plan, state_names)
    else:
        program = _sdpa_program(plan, state_names, sdpa_call or {})
    program.__name__ = program.__qualname__ = f"geoscale_{plan.key}"
    return program


def sdpa_call_options(node: Node) -> dict:
    """Static SDPA arguments of a node (scale resolved; dynamic flags at their hints)."""
    scale = arg(node, 6, "scale")
    scale = scalar_constant(scale) if scale is not None else None
    if scale is None:
        q = node.args[0].meta.get("example_value")
        scale = float(q.shape[-1]) ** -0.5
    return {"softmax_scale": scale,
            "is_causal": static_bool(arg(node, 5, "is_causal", False)),
            "enable_gqa": static_bool(arg(node, 7, "enable_gqa", False)),
            "dropout_p": scalar_constant(arg(node, 4, "dropout_p", 0.0)) or 0.0}


def rewrite(gm: GraphModule, plans: Sequence[scaling.SitePlan],
            states: Sequence[Sequence[str]]) -> GraphModule:
    """A new GraphModule: ``gm`` (unchanged) with every planned site replaced.

    ``states[i]`` are the state tensor names of ``plans[i]``; they become placeholders after
    the existing ones, in order, so the compiled function takes ``(*inputs, *state)``.
    """
    gm = copy.deepcopy(gm)  # Dynamo still reads the original's placeholders
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    state_nodes = []
    for plan, names in zip(plans, states):
        nodes = []
        for name in names:
            with graph.inserting_after(anchor):
                anchor = graph.placeholder(f"geoscale_{plan.key}_{name}")
            nodes.append(anchor)
        state_nodes.append(nodes)
    for plan, names, nodes in zip(plans, states, state_nodes):
        weights = [by_name[w] for w in plan.weight_names]
        if plan.lowering == "inplace":
            scores = by_name[plan.site.node_name("scores")]
            program = make_program(plan, names)
            with graph.inserting_after(scores):
                new = graph.call_function(program, (scores, *weights, *nodes))
            scores.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        else:
            node = by_name[plan.site.node]
            program = make_program(plan, names, sdpa_call_options(node))
            q, k, v = node.args[:3]
            with graph.inserting_before(node):
                new = graph.call_function(program, (q, k, v, arg(node, 3, "attn_mask"),
                                                    *weights, *nodes))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
    graph.lint()
    # a fresh GraphModule: without Dynamo's metadata, which aot_autograd would insist on
    return GraphModule(gm, graph)
