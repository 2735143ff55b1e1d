"""geoscale_fx.analysis.norms.l2_clip: the clip (and the scaled L2 normalization t·h/max(‖h‖, ε)) is
recognised with its threshold in its spellings, a
clip with a positive floor is not (it bounds nothing), and the recognised output's norm never
exceeds t (checked numerically, inputs scaled ×1000)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.fx.graph_ops import ValueKinds, op_of
from geoscale_fx.analysis.norms.l2_clip import l2_clip


class _Clip(nn.Module):
    def __init__(self, style: str, t: float = 3.0):
        super().__init__()
        self.style, self.t = style, t
        self.gain = nn.Parameter(torch.full((8,), 2.0))

    def forward(self, x):
        h = x * self.gain
        ratio = self.t / (torch.linalg.vector_norm(h, dim=-1, keepdim=True) + 1e-6)
        if self.style == "clamp":
            factor = ratio.clamp(max=1.0)
        elif self.style == "clamp_max":
            factor = torch.clamp_max(ratio, 1.0)
        elif self.style == "normalized":        # ZAYA: t / max(‖h‖, ε), no cap
            factor = self.t / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp_min(1e-7)
        elif self.style == "maximum":
            factor = self.t / torch.maximum(h.norm(p=2, dim=-1, keepdim=True),
                                            torch.tensor(1e-7))
        elif self.style == "negative_floor":    # max(‖h‖, -1): no floor at all, still ≤ t
            factor = self.t / h.norm(p=2, dim=-1, keepdim=True).clamp_min(-1.0)
        else:                                   # "floored": never below 0.5, bounds nothing
            factor = ratio.clamp(min=0.5, max=1.0)
        return h * factor


def _clip_of(style: str):
    model = _Clip(style)
    (graph,) = capture_graphs(model, torch.randn(2, 5, 8))
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    out = [n for n in graph.gm.graph.nodes if op_of(n) == "mul"][-1]
    return model, l2_clip(out, kinds)


@pytest.mark.parametrize("style", ["clamp", "clamp_max", "normalized", "maximum"])
def test_a_clip_gives_its_threshold_and_its_output_norm_never_exceeds_it(style):
    model, found = _clip_of(style)
    assert found is not None and found[1] == pytest.approx(3.0)
    x = 1000.0 * torch.randn(64, 5, 8)
    norms = torch.linalg.vector_norm(model(x), dim=-1)
    assert float(norms.max()) <= 3.0 * (1 + 1e-6)


def test_a_clip_with_a_positive_floor_is_not_recognised():
    _, found = _clip_of("floored")
    assert found is None


def test_a_norm_floored_below_zero_is_not_a_floor():
    """``t / max(‖h‖, −1)`` divides by ‖h‖ itself (a zero row gives nan, not ≤ t): the floor
    must be ≥ 0 to count."""
    _, found = _clip_of("negative_floor")
    assert found is None
