"""geoscale_fx.analysis.modifiers.sink: ``cat([S, sink], -1)`` recognised (and the cats that are
not sinks), the site modifier a sink becomes, and its bound against the sink logits themselves."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from geoscale_fx.analysis.index.index_track import Unsupported
from geoscale_fx.analysis.modifiers import sink
from geoscale_fx.analysis.modifiers.sink import Sink, SinkDraft
from tests.analysis.modifiers.scores import H, captured, nodes
from tests.analysis_checks import Captured


def _joined(m, s):
    b, _, n, _ = s.shape
    return torch.cat([s, m.sinks.reshape(1, -1, 1, 1).expand(b, -1, n, -1)], dim=-1)


def test_a_parameter_sink_is_a_route_through_the_scores_naming_the_parameter():
    c = captured(_joined)
    (cat,) = nodes(c, "cat")
    (route,) = sink.recognize(cat, c.kinds)
    assert route.operand is cat.args[0][0]
    assert type(route.draft) is SinkDraft and route.draft.modifier is Sink
    assert route.draft.node.op == "placeholder" and "sinks" in route.draft.node.name
    modifier = route.draft.site_modifier(SimpleNamespace(node=cat), c.kinds)
    name = route.draft.node.name
    assert (type(modifier), modifier.node, modifier.param, modifier.side) == (Sink, name, name,
                                                                             None)
    assert (route.masks, route.logits, route.names_blocker) == (False, False, False)


@pytest.mark.parametrize("f,answer", [
    (lambda m, s: torch.cat([s, s], dim=0)[:2], ()),                  # not along the keys
    (lambda m, s: torch.cat([s, s], dim=-1), None),                  # no width-1 sink
])
def test_a_cat_that_joins_no_sink_column_leads_nowhere(f, answer):
    c = captured(f)
    assert sink.recognize(nodes(c, "cat")[0], c.kinds) == answer


def test_the_bound_covers_every_logit_the_softmax_receives_with_the_sinks():
    """``max(bound, max|sink|)`` against ``max|cat([S, sink])|`` recomputed per head."""
    torch.manual_seed(0)
    sinks = torch.tensor([3.0, -40.0], dtype=torch.float64)
    s = torch.randn(H, 6, 6, dtype=torch.float64) * torch.tensor([1.0, 60.0])[:, None, None]
    joined = torch.cat([s, sinks[:, None, None].expand(H, 6, 1)], dim=-1)
    bound = sink.Sink("cat", param="p").transform(s.abs().amax(dim=(1, 2)), (),
                                                  {"p": sinks}.__getitem__)
    observed = joined.abs().amax(dim=(1, 2))
    assert bool((observed <= bound).all())
    assert bound.tolist() == [40.0, max(40.0, float(s[1].abs().max()))]


class _Projected(nn.Module):
    """Sink logits per query and head projected from an RMSNorm'd input, (B, H, L, 1)."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.RMSNorm(16), nn.Linear(16, H)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 3.0)

    def forward(self, x):
        return self.proj(self.norm(x)).transpose(1, 2).unsqueeze(-1)


def test_a_projected_sink_is_bounded_by_rho_times_its_row_norms_plus_its_bias():
    torch.manual_seed(0)
    model = _Projected()
    c = Captured.of(model, torch.randn(2, 5, 16))
    node = nodes(c, "unsqueeze")[0]
    modifier = SinkDraft(Sink, node).site_modifier(SimpleNamespace(node=node), c.kinds)
    assert modifier.param is None and modifier.side.features == ((0,), (1,))
    by_name = {n.name: n for n in c.gm.graph.nodes}
    bound = modifier.transform(torch.zeros(1, dtype=torch.float64), (),
                               lambda name: c.value(by_name[name]))
    w, b, g = (p.detach().double() for p in (model.proj.weight, model.proj.bias,
                                             model.norm.weight))
    expected = (16 ** 0.5 * torch.linalg.vector_norm(w * g, dim=1) + b.abs()).max()
    torch.testing.assert_close(bound, expected.reshape(1))
    with pytest.raises(Unsupported, match="`attn`: the sink logits `unsqueeze` are computed "
                                          "from the activations"):
        SinkDraft(Sink, node).site_modifier(SimpleNamespace(node=SimpleNamespace(name="attn")),
                                            None)
    assert not Sink.fp8_qkv and not Sink.caps
