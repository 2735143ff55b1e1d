"""The rewrite: replace each planned attention with a program that scales its logits to FP8.

For an SDPA site the call is replaced by ``program(q, k, v, attn_mask, *weights, *state)``
(fused flex_attention or explicit attention, ``geoscale_fx.kernels.logit_attention``; with
``lowering="fp8_qkv"`` attention on FP8 q, k, v, ``geoscale_fx.kernels.qkv_attention``; where k and v
are read from a KV cache, the program also takes the FP8 cache's scale nodes the operands
are dequantized with, ``analysis.forms.fp8_cache_reads``). For a model's own
explicit attention the softmax's input (the ``logits`` role: the scores ``q @ kᵀ``, or a
softcap's output) is routed through ``program(logits, *weights, *state)``, which quantizes it
in place of the original and leaves the model's mask, softmax and ``· V`` as they were.
``weights`` are the graph's own parameter nodes (placeholders under Dynamo), so the scale
follows the weights every step; ``state`` are new placeholders appended to the graph. Sites
without a plan are not touched.
"""
from __future__ import annotations

import copy
import logging
from typing import Callable, Sequence

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from geoscale_fx.planning import scaling
from geoscale_fx.kernels.logit_attention import explicit_attention, fused_attention
from geoscale_fx.numerics.distributed import per_layer_reduced, reduce_max
from geoscale_fx.core.fp8 import fake_quantize_logits
from geoscale_fx.analysis.fx.activation_checkpoint import RECOMPUTE_TAGS
from geoscale_fx.analysis.fx.dtensor import dtensor_of
from geoscale_fx.analysis.forms.fp8_cache_reads import fp8_cache_read
from geoscale_fx.analysis.fx.graph_ops import arg, baddbmm_args, scalar_constant, static_bool
from geoscale_fx.planning.plan import SitePlan
from geoscale_fx.kernels.qkv_attention import emulated_fp8_attention, fa3_fp8_attention
from geoscale_fx.planning.qkv_scaling import Read

log = logging.getLogger("geoscale_fx")

__all__ = ["make_program", "rewrite", "sdpa_call_options"]


def _per_scale_amax(plan: SitePlan, logits: torch.Tensor) -> torch.Tensor:
    """max|S| per head (``(H,)``, heads on dim -3) or per layer (``(1,)``).

    One reduction straight to ``(n_scale,)``: two (over L×L', then over the groups) leave
    Inductor a ``(B, H)`` buffer and a reshaped ``(H,)`` view of it in every decode step."""
    a = logits.detach().abs()
    if plan.n_scale == 1:
        return a.amax().reshape(1)
    rows = a.reshape(-1, plan.n_scale, *a.shape[-2:])      # (groups, n_scale, L, L')
    return rows.amax(dim=(0, 2, 3))


def _predict(plan: SitePlan, weights: dict, state: dict, seq_len) -> torch.Tensor:
    divisor = plan.policy.predict(weights, state, seq_len, reuse=plan.reuse_weights)
    state["scale"].copy_(divisor.expand_as(state["scale"]))
    return divisor


def _observe(plan: SitePlan, amax: torch.Tensor, predicted: torch.Tensor,
             state: dict) -> torch.Tensor:
    if per_layer_reduced(plan.site, plan.n_scale):   # one scale for heads on many ranks
        amax = reduce_max(amax, plan.site.shard)
    divisor = plan.policy.divisor_after(amax, predicted)
    scaling.observe(plan.policy, amax, divisor, state)
    return divisor


def _sdpa_program(plan: SitePlan, state_names: Sequence[str], call: dict) -> Callable:
    opt, n_w = plan.options, len(plan.weight_names)

    def program(q, k, v, attn_mask, *rest):
        weights = dict(zip(plan.weight_names, rest[:n_w]))
        state = dict(zip(state_names, rest[n_w:]))
        seq_len = max(q.shape[-2], k.shape[-2])
        divisor = _predict(plan, weights, state, seq_len) if plan.quantizes else None
        if plan.lowering == "fused":  # flex_attention has no dropout (never planned with it)
            fused_call = {k_: v_ for k_, v_ in call.items() if k_ != "dropout_p"}
            out = fused_attention(q, k, v, attn_mask, divisor, fmt=opt.fp8_format, **fused_call)
        else:
            def divisor_of(logits):
                if not plan.quantizes:
                    return None   # materialized anyway: what it saw is recorded
                return _observe(plan, _per_scale_amax(plan, logits), divisor, state)
            out = explicit_attention(q, k, v, attn_mask, fmt=opt.fp8_format,
                                     divisor_of=divisor_of, **call)
        scaling.finish_step(state, plan.site.cached_keys)
        return out.to(q.dtype)
    return program


def _qkv_program(plan: SitePlan, state_names: Sequence[str], call: dict,
                 cache_reads: dict | None = None) -> Callable:
    """SDPA on FP8 q, k, v with the descales the weights give this step. ``cache_reads``
    (a site reading a KV cache): per role ``"k"``/``"v"`` its ``FP8CacheRead`` or None; the
    program then takes the FP8 caches' scales after the weights."""
    opt, n_w = plan.options, len(plan.weight_names)
    read_roles = [r for r in "kv" if cache_reads is not None and cache_reads.get(r)]
    n_s = len(read_roles)

    def program(q, k, v, attn_mask, *rest):
        weights = dict(zip(plan.weight_names, rest[:n_w]))
        scales = dict(zip(read_roles, rest[n_w:n_w + n_s]))
        state = dict(zip(state_names, rest[n_w + n_s:]))
        reads = None
        if cache_reads is not None:
            reads = {r: Read(x) if r not in scales else
                     Read(x, scales[r], cache_reads[r].fmt, cache_reads[r].repeat)
                     for r, x in (("k", k), ("v", v))}
        descales = plan.policy.descales(weights, state, reuse=plan.reuse_weights, reads=reads)
        # k and v repeated to the query heads before the call (repeat_kv where a mask is
        # passed, or a model's own repeat_interleave): each kv head's descale for its copies
        repeat = k.shape[-3] // plan.site.n_kv_heads
        kernel = tuple(d.repeat_interleave(repeat, dim=-1) for d in descales) if repeat > 1 \
            else descales
        if plan.qkv_kernel == "fa3":
            out = fa3_fp8_attention(q, k, v, *kernel, softmax_scale=call["softmax_scale"],
                                    is_causal=call["is_causal"])
        else:
            out = emulated_fp8_attention(q, k, v, *kernel, attn_mask=attn_mask,
                                         fmt=opt.fp8_format, softmax_scale=call["softmax_scale"],
                                         is_causal=call["is_causal"],
                                         dropout_p=call["dropout_p"])
        plan.policy.record((q, k, v), descales, state)
        scaling.finish_step(state, plan.site.cached_keys)
        return out
    return program


def _lead_view(logits: torch.Tensor, plan: SitePlan) -> torch.Tensor:
    """``(batch, period, L, L')``: leading slices grouped so that index 1 picks the head."""
    site = plan.site
    if site.score_lead:   # heads outside the batch: specialize on the analysed lead
        logits = logits.reshape(*site.score_lead, *logits.shape[-2:])
    return logits.reshape(-1, len(site.score_heads), *logits.shape[-2:])


def _inplace_program(plan: SitePlan, state_names: Sequence[str], unit: float) -> Callable:
    """Quantize the site's own logits node; ``unit`` turns its value into softmax-input units
    (the scores ``q @ kᵀ`` still lack the site's scalar scale; a softcap's output does not)."""
    opt, site, n_w = plan.options, plan.site, len(plan.weight_names)

    def program(value, *rest):
        weights = dict(zip(plan.weight_names, rest[:n_w]))
        state = dict(zip(state_names, rest[n_w:]))
        if not plan.quantizes:
            scaling.finish_step(state, plan.site.cached_keys)
            return value
        divisor = _predict(plan, weights, state, max(value.shape[-2], value.shape[-1]))
        logits = _lead_view(value.float() * unit, plan)        # (batch, period, L, L')
        head_index = torch.tensor(site.score_heads, device=value.device)
        slot_amax = logits.detach().abs().amax(dim=(0, 2, 3))        # (period,)
        amax = (slot_amax.amax().reshape(1) if plan.n_scale == 1 else
                torch.zeros(plan.n_scale, device=value.device).scatter_reduce(
                    0, head_index, slot_amax, reduce="amax"))
        divisor = _observe(plan, amax, divisor, state)
        per_slot = divisor.index_select(0, head_index) if plan.n_scale > 1 else \
            divisor.expand(head_index.numel())
        quantized = fake_quantize_logits(logits, per_slot.reshape(1, -1, 1, 1), opt.fp8_format)
        scaling.finish_step(state, plan.site.cached_keys)
        return (quantized / unit).reshape(value.shape).to(value.dtype)
    return program


def make_program(plan: SitePlan, state_names: Sequence[str], *, sdpa_call: dict | None = None,
                 unit: float = 1.0, cache_reads: dict | None = None) -> Callable:
    """The function a rewritten node calls (named after the site for readable graphs)."""
    if plan.lowering == "inplace":
        program = _inplace_program(plan, state_names, unit)
    elif plan.lowering == "fp8_qkv":
        program = _qkv_program(plan, state_names, sdpa_call or {}, cache_reads)
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


def _replace_inplace(graph, by_name, plan: SitePlan, names, weights, nodes) -> None:
    site = plan.site
    target = by_name[site.node_name("logits") or site.node_name("scores")]
    unit = site.score_scale if target.name == site.node_name("scores") else 1.0
    program = make_program(plan, names, unit=unit)
    if site.score_op == "baddbmm" and target.name == site.node_name("scores"):
        _split_baddbmm(graph, target, program, weights, nodes)
        return
    with graph.inserting_after(target):
        new = graph.call_function(program, (target, *weights, *nodes))
    target.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)


def _split_baddbmm(graph, node: Node, program, weights, nodes) -> None:
    """``baddbmm(bias, q, k, β, α) = β·bias + α·(q @ k)``: quantize the product only; the
    additive position bias (ALiBi) joins after the quantization, like a mask."""
    bias, q, k, beta, alpha = baddbmm_args(node)
    with graph.inserting_before(node):
        product = graph.call_function(torch.bmm, (q, k))
        quantized = graph.call_function(program, (product, *weights, *nodes))
        if beta != 1.0:
            bias = graph.call_function(torch.mul, (bias, beta))
        new = graph.call_function(torch.add, (bias, quantized), {"alpha": alpha})
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _cache_reads(plan: SitePlan, node: Node) -> dict | None:
    """fp8_qkv at a site reading a KV cache: per role ``"k"``/``"v"``, the FP8 cache the
    operand is dequantized from (its scale bounds it), or None (its values bound it)."""
    if plan.lowering != "fp8_qkv" or not plan.site.cached_keys:
        return None
    reads = {role: fp8_cache_read(x) for role, x in (("k", node.args[1]), ("v", node.args[2]))}
    for role, found in reads.items():          # once per graph: one variant is compiled
        kind = "fp8_cache" if found is not None else "observed"
        counters["geoscale"][f"fp8_qkv_{role}_{kind}"] += 1
    log.info("geoscale: %s: fp8_qkv on cached keys: k/v descales from %s", plan.site.name,
             {r: f"the FP8 cache's scale ({f.fmt})" if f else "the values read"
              for r, f in reads.items()})
    return reads


def _replace_sdpa(graph, by_name, plan: SitePlan, names, weights, nodes) -> None:
    node = by_name[plan.site.node]
    reads = _cache_reads(plan, node)
    program = make_program(plan, names, sdpa_call=sdpa_call_options(node), cache_reads=reads)
    scales = [by_name[reads[r].scale] for r in "kv" if reads is not None and reads[r]]
    q, k, v = node.args[:3]
    with graph.inserting_before(node):
        new = graph.call_function(program, (q, k, v, arg(node, 3, "attn_mask"), *weights,
                                            *scales, *nodes))
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _local_weights(graph, weights: list[Node]) -> list[Node]:
    """Tensor parallel: the program reads the rank's local shard of a DTensor weight (the
    site's features index it; ``analysis.fx.dtensor``), never the global DTensor."""
    body = next(n for n in graph.nodes if n.op != "placeholder")
    local = []
    for node in weights:
        if dtensor_of(node) is None:
            local.append(node)
            continue
        with graph.inserting_after(node) if node.op != "placeholder" else \
                graph.inserting_before(body):
            local.append(graph.call_method("to_local", (node,)))
    return local


def rewrite(gm: GraphModule, plans: Sequence[SitePlan],
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
        weights = _local_weights(graph, [by_name[w] for w in plan.weight_names])
        replace = _replace_inplace if plan.lowering == "inplace" else _replace_sdpa
        tags = {k: v for k, v in by_name[plan.site.node].meta.items() if k in RECOMPUTE_TAGS}
        before = set(graph.nodes)
        replace(graph, by_name, plan, names, weights, nodes)
        for node in graph.nodes:   # a site in a checkpointed region: recomputed with it
            if tags and node not in before:
                node.meta.update(tags)
    graph.lint()
    # a fresh GraphModule: without Dynamo's metadata, which aot_autograd would insist on
    return GraphModule(gm, graph)
