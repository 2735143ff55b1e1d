"""``trig_origin``: a table read as ``m·cos(E)`` / ``m·sin(E)`` up to views."""
import torch

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.rotary.rotary_terms import trig_origin


def _table(fn, *args):
    """The graph's output node (the table) and its placeholders."""
    (graph,) = capture_graphs(fn, *args)
    nodes = list(graph.gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output").args[0]
    return (output[0] if isinstance(output, (tuple, list)) else output), \
        [n for n in nodes if n.op == "placeholder"]


def test_a_scaled_cos_through_views_gives_trig_angles_factor_and_chain():
    table, (angles,) = _table(lambda e: (torch.cos(e) * 2.0).unsqueeze(0), torch.randn(6, 8))
    trig, source, factor, chain, keeps_last = trig_origin(table)
    assert (trig, source, factor, keeps_last) == ("cos", angles, 2.0, True)
    assert [op for op, _ in chain] == ["unsqueeze"]


def test_a_transpose_on_the_way_does_not_keep_the_last_dim():
    table, _ = _table(lambda e: torch.sin(e).transpose(0, 1) * 0.5, torch.randn(8, 8))
    trig, _, factor, chain, keeps_last = trig_origin(table)
    assert (trig, factor, keeps_last) == ("sin", 0.5, False)
    assert [op for op, _ in chain] == ["transpose"]


def test_a_table_that_is_not_cos_or_sin_has_no_origin():
    table, _ = _table(lambda e: torch.exp(e).unsqueeze(0), torch.randn(6, 8))
    assert trig_origin(table) is None
