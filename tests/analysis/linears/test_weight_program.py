"""analysis.linears.weight_program: the slice of an ATen graph that computes from the weight."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from geoscale_fx.analysis.linears.aten_chains import A
from geoscale_fx.analysis.linears.weight_program import PREVIOUS, weight_program


def _graph(fn, *args):
    graph = make_fx(fn)(*args).graph
    return graph, [n for n in graph.nodes if n.op == "placeholder"], \
        [n for n in graph.nodes if n.op == "output"][0].args[0]


def test_the_slice_from_the_weight_replays_bit_for_bit():
    def f(x, w):
        s = 448.0 / w.abs().amax(dim=0, keepdim=True)
        return x.sum() + 1, (w * s).clamp(-448, 448).to(torch.float8_e4m3fn), s.reciprocal()

    w = torch.randn(8, 4)
    graph, (x_ph, w_ph), (_, bits, inv) = _graph(f, torch.randn(3), w)
    program = weight_program([bits, inv], w_ph, [(A._to_copy.default, (bits,),
                                                  {"dtype": torch.float32}),
                                                 (A.mul.Tensor, (PREVIOUS, inv), {})])
    assert all(isinstance(a, tuple) for _, args, _ in program.ops for a in args
               if isinstance(a, (tuple, list)))          # lists kept as tuples: hashable
    hash(program)
    for weight in (w, 3 * torch.randn(8, 4)):
        s = 448.0 / weight.abs().amax(dim=0, keepdim=True)
        expected = (weight * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s.reciprocal()
        assert torch.equal(program(weight), expected)


def test_a_slice_that_reads_anything_but_the_weight_is_refused():
    def f(x, w):
        return w * x.abs().max(), torch.ones((), device=w.device) * w

    graph, (x_ph, w_ph), (mixed, _) = _graph(f, torch.randn(3), torch.randn(2, 2))
    assert weight_program([mixed], w_ph) is None                  # reads the input
    devices = [n for n in graph.nodes if "device" in n.kwargs]
    assert devices and weight_program(devices, w_ph) is None     # a device argument
