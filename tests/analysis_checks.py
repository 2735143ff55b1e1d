"""Independent checks of an analysed site against what the captured graph really computes.

The graph is re-run with ``torch.fx.Interpreter`` recording every node; queries and keys are
read from the attention's own operands (before RoPE: the operand of the ``· cos`` product),
the normalized input x̂ is recomputed from the normalization's *input* with torch's own
``layer_norm`` / ``rms_norm`` (no affine), and logits come from the operands, not from the
analysis; ``ascend_inputs_embeds`` pushes the inputs against a bound.

Shared with them: ``assert_none_scaling_equals_eager`` (the converted model under
``scaling="none"`` against eager), ``audited_record`` (the record of one audited call),
``analysed_site`` (the one site of a model) and ``Captured`` (the provenance passes on a
captured graph's outputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Interpreter, Node

import geoscale_fx
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.numerics.head_weights import site_head_weights, site_term_weights
from geoscale_fx.numerics.logit_bounds import site_logit_bound
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.evaluate import ParamEvaluator
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, arg, matmul_operands, op_of
from geoscale_fx.analysis.sides.provenance import (NormalizedInput, find_projection,
                                           trace_normalized_input, trace_operand)
from geoscale_fx.analysis.index.replay_records import ReplayRecords


def model_output(out) -> torch.Tensor:
    """The tensor a model call answers: a Hugging Face output's ``logits``, a tuple's first
    element, else the output itself."""
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple) else out


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model_output(model(**inputs))
    return model_output(model(*inputs) if isinstance(inputs, tuple) else model(inputs))


def assert_none_scaling_equals_eager(model, inputs, convert=geoscale_fx.wrap, *, run=_call,
                                     rtol=1e-5, atol=1e-5, grad=False, **options):
    """``scaling="none"`` changes nothing: the model converted by ``convert(model,
    scaling="none", **options)`` (``wrap``; ``apply_``, which converts in place; a
    ``torch.compile`` with the backend) answers what the eager model answers, within
    ``rtol``/``atol`` (0 and 0: equal). ``run(model, inputs)`` is one call (``inputs``: a
    tensor, a tuple of positional or a dict of keyword arguments; the logits of a Hugging
    Face output) or a whole generation. The eager answer comes first, then the conversion on
    a fresh Dynamo cache; everything runs without grad unless ``grad`` (then the graph
    compiled is the training one). Returns the converted model and its answer, for what a
    test checks besides."""
    with torch.set_grad_enabled(grad):
        expected = run(model, inputs)
        torch._dynamo.reset()
        converted = convert(model, scaling="none", **options)
        actual = run(converted, inputs)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    return converted, actual


def audited_record(model, inputs, compiler: str = "aot_eager"):
    """The record of the one site of ``wrap(model, audit=True)`` (geometry scaling) after one
    call without grad, on a fresh Dynamo cache with ``counters`` cleared first."""
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        wrapped = geoscale_fx.wrap(model, compiler=compiler, audit=True)
        _call(wrapped, inputs)
    (record,) = wrapped.geoscale.records.values()
    return record


def analysed_site(model, *args, **kwargs):
    """The one site ``analyze_graph`` finds in the one graph Dynamo captures of
    ``model(*args, **kwargs)``."""
    (graph,) = capture_graphs(model, *args, **kwargs)
    (site,) = analyze_graph(graph.gm, graph.example_inputs)
    return site


@dataclass
class Captured:
    """One captured graph whose outputs are attention operands, and the provenance passes
    (``analysis.sides.provenance``) run on them as the analysis runs them, for a query."""
    gm: GraphModule
    inputs: list
    kinds: ValueKinds

    @classmethod
    def of(cls, module, *args) -> "Captured":
        (graph,) = capture_graphs(module, *args)
        return cls(graph.gm, graph.example_inputs,
                   ValueKinds(graph.gm.graph, graph.example_inputs))

    @property
    def operands(self) -> list[Node]:
        output = next(n for n in self.gm.graph.nodes if n.op == "output")
        return list(output.args[0])

    def node(self, target) -> Node:
        """The single call node whose target is ``target`` (a function or a method name)."""
        found = [n for n in self.gm.graph.nodes if n.target is target or n.target == target]
        assert len(found) == 1, found
        return found[0]

    def records(self) -> ReplayRecords:
        return ReplayRecords(ParamEvaluator(self.gm, self.inputs, self.kinds))

    def value(self, node: Node) -> torch.Tensor:
        return ParamEvaluator(self.gm, self.inputs, self.kinds).evaluate(node)

    def trace(self, operand: Node, records: ReplayRecords | None = None):
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return trace_operand(operand, self.kinds, records or self.records(), "query", order)

    def track(self, operand: Node):
        return self.trace(operand).track

    def normalized(self, operand: Node | None = None) -> NormalizedInput:
        (projection,), _, _, _ = find_projection(operand or self.operands[0], self.kinds,
                                                 "query")
        return trace_normalized_input(projection.x, self.kinds, projection.root)


class Recorder(Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def record(gm, example_inputs) -> dict:
    rec = Recorder(gm)
    rec.run(*[int(x.node.hint) if isinstance(x, torch.SymInt) else x for x in example_inputs])
    return rec.values


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def normalized_input(gm, values, projection) -> torch.Tensor:
    """x̂ (no gain/offset) recomputed from the normalization node's input, shape (..., d)."""
    node = _node(gm, projection.source.node)
    op = op_of(node)
    d = projection.model_dim
    if op == "layer_norm":
        return F.layer_norm(values[node.args[0].name], (d,), eps=arg(node, 4, "eps", 1e-5))
    if op == "rms_norm":
        return F.rms_norm(values[node.args[0].name], (d,), eps=arg(node, 3, "eps"))
    if op == "encoder_layer":
        src = values[node.args[0].name]
        if node.args[8]:  # norm_first: the layer normalizes its own input
            return F.layer_norm(src, (d,), eps=node.args[9])
        raise AssertionError("post-norm encoder layers are traced to the previous layer")
    return values[node.name]  # decomposed RMSNorm: the node is x * rsqrt(mean(x²) + eps)


def recomputed(site, side, x_hat) -> torch.Tensor:
    """(..., n_heads, d_h) from head_weights() on x̂."""
    hw = site_head_weights(site)
    a, c = (hw.a_q, hw.c_q) if side == "q" else (hw.a_k, hw.c_k)
    out = torch.einsum("...d,ndj->...nj", x_hat.to(a.dtype), a)
    return out + c if c is not None else out


def operands(gm, site):
    """(q, k) operand nodes of the site with the key as (…, L', D)."""
    if site.kind == "sdpa":
        node = _node(gm, site.node)
        return node.args[0], node.args[1], False
    scores = _node(gm, site.node_name("scores"))
    if op_of(scores) == "einsum":
        return scores.args[1], scores.args[2], False
    if op_of(scores) == "baddbmm":
        return (*matmul_operands(scores), True)
    return scores.args[0], scores.args[1], True


def pre_rope(gm, values, operand, rotary):
    """The operand's value before its rotary embedding (the factor of ``· cos``)."""
    if rotary is None:
        return values[operand.name], None
    ancestors, stack = set(), [operand]
    while stack:
        n = stack.pop()
        if n not in ancestors:
            ancestors.add(n)
            stack.extend(n.all_input_nodes)
    cos = _node(gm, rotary.cos_node)
    for user in cos.users:
        if op_of(user) == "mul" and user in ancestors:
            other = user.args[0] if user.args[1] is cos else user.args[1]
            return values[other.name], values[operand.name]
    raise AssertionError("no ·cos product found")


def to_bhld(t, batch):
    """(B, H, L, D) from (B, H, L, D) or heads merged into the batch (B·H, L, D)."""
    return t if t.dim() == 4 else t.reshape(batch, -1, t.shape[-2], t.shape[-1])


def check_projection_matches(gm, values, site, batch, atol=1e-5):
    """q and k recomputed from head_weights() equal the model's own (before RoPE)."""
    q_node, k_node, k_transposed = operands(gm, site)
    for side, node, proj in (("q", q_node, site.q), ("k", k_node, site.k)):
        x_hat = normalized_input(gm, values, proj)
        rec = proj.operand_gain * recomputed(site, side, x_hat).transpose(-2, -3)  # (B,n,L,d_h)
        real, rotated_out = pre_rope(gm, values, node, proj.rotary)
        if side == "k" and k_transposed and proj.rotary is None:
            real = real.transpose(-1, -2)
        real = to_bhld(real, batch)
        width = real.shape[-1]
        rec_part = rec[..., :width]
        if real.shape[1] != rec.shape[1]:                           # GQA repeated keys
            rec_part = rec_part.repeat_interleave(real.shape[1] // rec.shape[1], dim=1)
        torch.testing.assert_close(real.to(rec.dtype), rec_part, atol=atol, rtol=1e-4)
        if rotated_out is not None and width < rec.shape[-1]:       # partial rotary: the rest
            rest = to_bhld(rotated_out, batch)[..., width:]
            torch.testing.assert_close(rest.to(rec.dtype), rec[..., width:], atol=atol,
                                       rtol=1e-4)


def observed_logits(gm, values, site, batch) -> torch.Tensor:
    """Per query head max |S| over the batch, from the operands and the site's own scale."""
    q_node, k_node, k_transposed = operands(gm, site)
    q = to_bhld(values[q_node.name], batch)
    k = values[k_node.name]
    k = to_bhld(k.transpose(-1, -2) if k_transposed else k, batch)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = site.softmax_scale * (q.double() @ k.double().transpose(-1, -2))
    return s.abs().amax(dim=(0, 2, 3))


def mha_projection_reference(module_in_proj_weight, module_in_proj_bias, x_affine, n_heads):
    """q, k of nn.MultiheadAttention computed from the module's own parameters."""
    e = module_in_proj_weight.shape[1]
    qkv = F.linear(x_affine, module_in_proj_weight, module_in_proj_bias)
    q, k = qkv[..., :e], qkv[..., e:2 * e]
    shape = x_affine.shape[:-1] + (n_heads, e // n_heads)
    return q.reshape(shape), k.reshape(shape)


def scale_up_gains_and_biases(model, factor=4.0):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name or "sinks" in name or "LayerNorm" in name or (
                    name.endswith("bias") and any(t in name for t in ("c_attn", "query", "key",
                                                                      "q_proj", "k_proj"))):
                p.mul_(factor).add_(0.5 * torch.randn_like(p))


def ascend_inputs_embeds(graph, objective, steps: int) -> None:
    """Gradient ascent (Adam, lr 0.1) on the ``inputs_embeds`` input of a captured graph,
    from a random start shaped like its example: each step re-runs the graph on the current
    embeddings, recording every node (``record``), and maximizes ``objective(values)`` (a
    scalar tensor; the objective also keeps whatever it measures)."""
    pos = [i for i, n in enumerate(graph.gm.graph.nodes) if n.op == "placeholder"
           and "inputs_embeds" in n.name][0]
    embeds = torch.randn(graph.example_inputs[pos].shape, requires_grad=True)
    opt = torch.optim.Adam([embeds], lr=0.1)
    for _ in range(steps):
        inputs = list(graph.example_inputs)
        inputs[pos] = embeds
        loss = -objective(record(graph.gm, inputs))
        opt.zero_grad()
        loss.backward()
        opt.step()


def adversarial(model, steps=25, batch=2, seq=12, d=64):
    """Gradient ascent on inputs_embeds to maximize every site's max|S| / bound."""
    graphs = capture_graphs(model, inputs_embeds=torch.randn(batch, seq, d))
    graph = graphs[0]
    sites = analyze_graph(graph.gm, graph.example_inputs)
    bounds = [site_logit_bound(s) for s in sites]
    best = torch.zeros(len(sites), dtype=torch.float64)
    best_logit = torch.zeros(len(sites), dtype=torch.float64)

    def objective(values):
        nonlocal best, best_logit
        observed = [observed_logits(graph.gm, values, s, batch) for s in sites]
        ratios = torch.stack([(o / b).max() for o, b in zip(observed, bounds)])
        best = torch.maximum(best, ratios.detach())
        best_logit = torch.maximum(best_logit, torch.stack([o.max() for o in observed]).detach())
        return ratios.sum()

    ascend_inputs_embeds(graph, objective, steps)
    return sites, best, best_logit


def _side_norms(gm, values, site, side_name) -> torch.Tensor:
    """Σ_t ‖side_t,h(m)‖² over the site's terms, recomputed from each term's own source and
    head weights: (B, n_heads, L)."""
    total = None
    for t, (term, hw) in enumerate(zip(site.terms, site_term_weights(site))):
        side = term.q if side_name == "q" else term.k
        a, c = (hw.a_q, hw.c_q) if side_name == "q" else (hw.a_k, hw.c_k)
        x_hat = normalized_input(gm, values, side).double()
        out = torch.einsum("...d,ndj->...nj", x_hat, a.double())
        out = (out + c.double() if c is not None else out) * side.operand_gain
        sq = out.pow(2).sum(-1).transpose(-1, -2)                        # (B, n, L)
        total = sq if total is None else total + sq
    return total


def check_term_norms(gm, values, site, batch, rtol=1e-4):
    """Every term recomputed from its own source and weights: per head and token, the
    squared norms of the terms' parts add up to the attention operand's own (rotations keep
    norms; a rotary factor f or a per-position multiplier t scales them by at most f², t²).
    Sides normalized after the projection (QK-norm) are left to the adversarial check."""
    q_node, k_node, k_transposed = operands(gm, site)
    for side_name, node in (("q", q_node), ("k", k_node)):
        sides = [t.q if side_name == "q" else t.k for t in site.terms]
        if any(s.weight is None for s in sides):
            continue
        real = values[node.name]
        if side_name == "k" and k_transposed:
            real = real.transpose(-1, -2)
        real = to_bhld(real, batch).double().pow(2).sum(-1)             # (B, H, L)
        rec = _side_norms(gm, values, site, side_name)
        if real.shape[1] != rec.shape[1]:                               # GQA repeated keys
            rec = rec.repeat_interleave(real.shape[1] // rec.shape[1], dim=1)
        ratio = real / rec
        gain = max(max(s.rotary.factor, 1.0) if s.rotary is not None else 1.0 for s in sides)
        most = (gain * max(s.position_gain for s in sides)) ** 2
        assert float(ratio.min()) >= 1 - rtol and float(ratio.max()) <= most * (1 + rtol), \
            (side_name, float(ratio.min()), float(ratio.max()), most)
        exact = all(s.position_gain == 1.0 and (s.rotary is None or not s.rotary.partial)
                    for s in sides) and len({s.rotary.factor if s.rotary else 1.0
                                             for s in sides}) == 1
        if exact:
            torch.testing.assert_close(ratio, torch.full_like(ratio, most), rtol=rtol, atol=0)
