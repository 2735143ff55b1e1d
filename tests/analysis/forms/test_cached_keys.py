"""geoscale_fx.analysis.forms.cached_keys: ``whole_vector_slices``, ``repeated_kv_heads`` and
``key_sources`` through GQA's ``repeat_kv`` on Dynamo graphs (tests/test_cached_keys.py
covers concatenation, slices and writes on hand-made graphs)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.forms.cached_keys import key_sources, repeated_kv_heads, whole_vector_slices
from geoscale_fx.analysis.fx.graph_ops import ValueKinds

S = slice(None)


@pytest.mark.parametrize("index, expected", [
    ((S, S, slice(-4, None)), True),                     # last positions: whole vectors
    ((slice(0, 1), S, slice(2, 5), S), True),            # a batch row and positions
    ((S, slice(0, 1)), False),                           # one head: per-head maxima differ
    ((S, S, S, slice(0, 4)), False),                     # part of each vector
    ((S, S, 3), False),                                  # an integer drops the axis
    ((Ellipsis, slice(0, 2)), False),
])
def test_whole_vector_slices(index, expected):
    assert whole_vector_slices(index) is expected


def _repeat_kv(x, r, style):
    b, h, n, d = x.shape
    if style == "none_index":                            # Hugging Face's repeat_kv
        return x[:, :, None, :, :].expand(b, h, r, n, d).reshape(b, h * r, n, d)
    if style == "unsqueeze":
        return x.unsqueeze(2).expand(b, h, r, n, d).reshape(b, h * r, n, d)
    # heads tiled, not repeated: head h reads stored head h % H (not h // r)
    return x[:, None].expand(b, r, h, n, d).reshape(b, h * r, n, d)


class _Decode(torch.nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style

    def forward(self, q, past, new):
        k = torch.cat([past, new * 2.0], dim=2)                            # (B, H_kv, L, d)
        k = _repeat_kv(k, 2, self.style)                                   # (B, 2·H_kv, L, d)
        return F.scaled_dot_product_attention(q, k, k)


def _graph(style):
    inputs = (torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 1, 8))
    graph = capture_graphs(_Decode(style), *inputs)[0]
    nodes = list(graph.gm.graph.nodes)
    sdpa = next(n for n in nodes if "scaled_dot_product" in str(n.target))
    return graph, sdpa


@pytest.mark.parametrize("style", ["none_index", "unsqueeze"])
def test_repeat_kv_is_recognized_and_keys_keep_their_past_and_fresh_parts(style):
    graph, sdpa = _graph(style)
    source, repeat = repeated_kv_heads(sdpa.args[1])
    assert repeat == 2 and tuple(source.meta["example_value"].shape) == (1, 2, 6, 8)
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    found = key_sources(sdpa.args[1], sdpa, kinds)
    past = next(n.name for n in graph.gm.graph.nodes if n.op == "placeholder"
                and tuple(n.meta["example_value"].shape) == (1, 2, 5, 8))
    assert found.past == ((past, 2),)
    assert len(found.fresh) == 1 and found.fresh[0][1] == 2


def test_tiled_heads_are_not_a_repeat_and_the_whole_key_is_fresh():
    graph, sdpa = _graph("tiled")
    assert repeated_kv_heads(sdpa.args[1]) is None
    kinds = ValueKinds(graph.gm.graph, graph.example_inputs)
    # the tiling reshape is a leaf (measured whole): no past cache behind it, no running max
    assert key_sources(sdpa.args[1], sdpa, kinds) is None
