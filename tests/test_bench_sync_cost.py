"""bench.sync_cost: the stated FLOP formulas against what runs — torch's FLOP counter on a
calibration forward, and the floating-point operations attention_scales dispatches, counted
op by op — on a small Llama."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

transformers = pytest.importorskip("transformers")

import geoscale_fx  # noqa: E402
from bench import sync_cost  # noqa: E402

D, HEADS, KV_HEADS, LAYERS, MLP, VOCAB = 128, 8, 2, 2, 192, 64
SHAPE = (LAYERS, D, HEADS, KV_HEADS, D // HEADS, MLP, VOCAB)


def _llama(attn: str = "sdpa"):
    config = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=D,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      intermediate_size=MLP, vocab_size=VOCAB,
                                      attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_calibration_forward_flops_are_what_torch_counts():
    model = _llama("eager")          # attention as matmuls, which the counter sees
    sequences, length = 3, 16
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.model(torch.randint(0, VOCAB, (sequences, length)))   # no LM head
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = counts.pop("aten.mm")
    attention = counts.pop("aten.bmm")              # QKᵀ and P·V over the whole L×L square
    assert not counts
    assert linear == 2 * sync_cost.block_weights(SHAPE) * sequences * length
    # causal kernels skip the upper triangle: the formula counts half the square
    assert sync_cost.calibration_flops(SHAPE, sequences, length) == linear + attention / 2


class _ArithmeticCount(TorchDispatchMode):
    """Floating-point operations dispatched: one per output entry of an elementwise op, one
    per entry folded away by a reduction."""
    ELEMENTWISE = {"mul", "add", "sub", "div", "sqrt", "abs", "pow", "maximum", "neg"}
    REDUCTIONS = {"sum", "amax", "mean"}

    def __init__(self):
        super().__init__()
        self.flops, self.unknown = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            if name in self.ELEMENTWISE:
                self.flops += out.numel()
            elif name in self.REDUCTIONS:
                self.flops += args[0].numel() - out.numel()
            elif name in ("mm", "bmm", "matmul", "mv", "addmm", "linalg_eigh"):
                self.unknown.add(name)
        return out


@pytest.mark.slow         # traces the model (attention_scales' first call)
def test_geoscale_flops_are_what_attention_scales_computes():
    model = _llama()
    ids = torch.randint(0, VOCAB, (1, 8))
    geoscale_fx.attention_scales(model, ids)                # the trace, once
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0)                                     # an update: every bound again
    count = _ArithmeticCount()
    with count:
        geoscale_fx.attention_scales(model, ids)
    formula = sync_cost.geoscale_flops(SHAPE, rope=True, layer_norm=False)
    assert not count.unknown
    assert formula <= count.flops <= 1.02 * formula       # left out: terms of order n·d_h
