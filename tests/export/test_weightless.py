"""geoscale_fx/export/weightless.py: stand-ins of one stored zero, and products with ``c·𝟙``.

The products are checked against torch's own on the operand made dense (``contiguous()``),
the stand-ins against the meta model they replace.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.export.weightless import ConstantProducts, repeated_value, weightless

aten = torch.ops.aten


def _constant(shape, value, dtype=torch.float32) -> torch.Tensor:
    return torch.full((), value, dtype=dtype).expand(shape)


def test_repeated_value_only_of_tensors_whose_every_stride_is_zero():
    c = _constant((3, 4), 2.5)
    assert float(repeated_value(c)) == 2.5 and repeated_value(c).dim() == 0
    assert float(repeated_value(c.t()[1:])) == 2.5
    assert repeated_value(torch.ones(3, 4)) is None                  # dense
    assert repeated_value(torch.ones(4).expand(3, 4)) is None        # one stride is 1
    assert repeated_value(torch.ones(1)) is None                     # a single entry


@pytest.mark.parametrize("value", [0.0, 1.5])
@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_products_with_a_constant_operand_are_torchs_products(value, side):
    g = torch.Generator().manual_seed(0)
    dense = {"a": torch.randn(5, 7, generator=g), "b": torch.randn(7, 3, generator=g),
             "A": torch.randn(2, 5, 7, generator=g), "B": torch.randn(2, 7, 3, generator=g)}
    ops = {k: (_constant(v.shape, value) if (k.lower() == "a") == (side == "left")
               or side == "both" else v) for k, v in dense.items()}
    bias, bias3 = torch.randn(3, generator=g), torch.randn(2, 1, 3, generator=g)
    calls = [(aten.mm.default, ("a", "b"), {}), (aten.bmm.default, ("A", "B"), {}),
             (aten.addmm.default, (bias, "a", "b"), {"beta": 0.5, "alpha": 2.0}),
             (aten.baddbmm.default, (bias3, "A", "B"), {}),
             (aten.addmm.default, (bias, "a", "b"), {"beta": 0})]
    for op, args, kwargs in calls:
        with ConstantProducts():
            got = op(*[ops[a] if isinstance(a, str) else a for a in args], **kwargs)
        ref = op(*[ops[a].contiguous() if isinstance(a, str) else a for a in args], **kwargs)
        torch.testing.assert_close(got, ref, msg=f"{op} {side} {value}")
        assert got.is_contiguous()


def test_other_ops_and_dense_products_are_left_to_torch():
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    with ConstantProducts():
        assert torch.equal(a @ b, torch.mm(a, b))
        assert torch.equal(torch.softmax(a, -1), a.softmax(-1))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 16)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.ones(8))

    def forward(self, ids):                                           # (B, T)
        x = self.embed(ids) * self.table                              # (B, T, 8)
        return self.head(x) + self.proj(x).sum(-1, keepdim=True)     # (B, T, 10)


def test_weightless_stands_in_for_meta_tensors_and_puts_them_back():
    with torch.device("meta"):
        model = _Tied()
    before = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    with weightless(model) as originals, torch.no_grad():
        assert model.head.weight is model.embed.weight                # still tied
        stand_ins = [*model.parameters(), *model.buffers()]
        assert all(t.device.type == "cpu" and t.untyped_storage().nbytes() == t.itemsize
                   and not t.any() for t in stand_ins)
        assert {id(originals[id(t)]) for t in stand_ins} == {id(t) for t in before.values()}
        out = model(torch.tensor([[1, 2, 3]]))
    assert torch.equal(out, torch.zeros(1, 3, 10))                   # all weights 0
    after = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)


def test_graph_mode_is_entered_around_each_run_of_a_captured_graph(monkeypatch):
    """A graph break makes two graphs; the mode is entered once per graph run, and both
    products inside are computed from the identity (the 1000×1000 constant is never made
    dense)."""
    from geoscale_fx.export import weightless as module

    entered, identities = [], []
    product = module._product

    def counting(a, b):
        out = product(a, b)
        identities.append(out is not None)
        return out

    monkeypatch.setattr(module, "_product", counting)

    class Counting(ConstantProducts):
        def __enter__(self):
            entered.append(1)
            return super().__enter__()

    weight = _constant((1000, 1000), 0.5)

    def f(x):
        y = x @ weight
        torch._dynamo.graph_break()
        return y @ weight

    x = torch.ones(2, 1000)
    graphs = capture_graphs(f, x, graph_mode=Counting)
    assert len(graphs) == 2 and len(entered) == 2 and identities == [True, True]
    torch.testing.assert_close(f(x), (x @ weight.contiguous()) @ weight.contiguous())
