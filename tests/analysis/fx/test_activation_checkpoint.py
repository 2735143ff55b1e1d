"""``analysis.fx.activation_checkpoint``: attention inside activation-checkpointed regions (Hugging Face
gradient checkpointing, TRL's default) is found, rewritten, and still recomputed in the
backward — checked against eager execution (values and gradients) and against plain
``torch.compile`` of the same checkpointed model (bytes saved for the backward)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import geoscale_fx
from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.analyze import analyze_graph
from geoscale_fx.analysis.fx.activation_checkpoint import inline_activation_checkpoints
from tests.analysis_checks import assert_none_scaling_equals_eager

B, L, D, H = 2, 8, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # (B, H, L, D/H)
        return x + self.out(a.transpose(1, 2).reshape(B, L, D))


class Checkpointed(nn.Module):
    def __init__(self, layers: int = 3, use_checkpoint: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.use_checkpoint else layer(x)
        return x.square().mean()


def test_bodies_are_inlined_and_tagged_for_recomputation():
    model = Checkpointed()          # alive: the sites are named in it
    graph = capture_graphs(model, torch.randn(B, L, D))[0]
    hop = torch.ops.higher_order.tag_activation_checkpoint
    assert sum(n.target is hop for n in graph.gm.graph.nodes) == 3
    assert analyze_graph(graph.gm, graph.example_inputs) == []     # hidden in the bodies
    inlined = inline_activation_checkpoints(graph.gm)
    assert not any(n.target is hop for n in inlined.graph.nodes)
    sdpa = [n for n in inlined.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert [n.meta["recompute"] for n in sdpa] == [CheckpointPolicy.PREFER_RECOMPUTE] * 3
    assert len({n.meta["ac_graph_id"] for n in sdpa}) == 3          # one id per region
    sites = analyze_graph(inlined, graph.example_inputs)
    assert [s.name for s in sites] == [f"layers.{i}" for i in range(3)]
    assert all(s.supported for s in sites)
    x = torch.randn(B, L, D)
    assert torch.equal(inlined(*[x if i == 0 else v for i, v in enumerate(
        graph.example_inputs)])[0], graph.gm(*[x if i == 0 else v for i, v in enumerate(
            graph.example_inputs)])[0])


def test_a_graph_without_checkpoints_is_returned_as_is():
    graph = capture_graphs(Checkpointed(use_checkpoint=False), torch.randn(B, L, D))[0]
    assert inline_activation_checkpoints(graph.gm) is graph.gm


def test_training_through_checkpoints_equals_eager_with_gradients():
    model = Checkpointed()
    x = torch.randn(B, L, D)

    def run(m, inputs):
        m.zero_grad()
        loss = m(inputs)
        loss.backward()
        return torch.cat([loss.reshape(1)] + [p.grad.reshape(-1) for p in m.parameters()])

    assert_none_scaling_equals_eager(model, x, convert=geoscale_fx.apply_, run=run, grad=True,
                                     compiler="aot_eager")


def _saved_bytes(model, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    loss.backward()
    return total


@pytest.mark.slow
def test_checkpointed_sites_are_scaled_and_still_recomputed():
    """geoscale rewrites the attention inside the regions (FP8 in training) and saves no
    more for the backward than plain ``torch.compile`` of the checkpointed model."""
    x = torch.randn(B, L, D)
    saved = {}
    for name, use_checkpoint in (("plain", True), ("geoscale", True),
                                 ("geoscale, no checkpoint", False)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Checkpointed(use_checkpoint=use_checkpoint)
        if name == "plain":
            model.compile(backend="aot_eager")
        else:
            geoscale_fx.apply_(model, compiler="aot_eager")
        _saved_bytes(model, x)               # the compile
        saved[name] = _saved_bytes(model, x)
        if name == "geoscale":
            rows = geoscale_fx.report(model).rows
            assert [r["site"] for r in rows] == [f"layers.{i}" for i in range(3)]
            assert all(r["steps"] == 2 and r["lowering"] == "explicit" for r in rows)
    assert saved["geoscale"] <= 1.1 * saved["plain"]
    assert saved["geoscale"] < 0.6 * saved["geoscale, no checkpoint"]
