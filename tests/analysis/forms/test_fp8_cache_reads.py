"""geoscale_fx.analysis.forms.fp8_cache_reads: ``fp8_cache_read`` on Dynamo graphs — a GQA repeat
after the dequantization, a per-tensor scale, and operands it must leave alone
(tests/test_fp8_qkv.py covers the plain per-head form and its descale numerics)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from geoscale_fx.analysis.capture import capture_graphs
from geoscale_fx.analysis.forms.fp8_cache_reads import FP8_STORAGE, FP8CacheRead, fp8_cache_read


class _Read(torch.nn.Module):
    """k = dequantize(bits, scale) (B, H_kv, L, d), optionally ``repeat_kv``-ed by 2."""

    def __init__(self, repeat=False, scale_shape=(1, -1, 1, 1), flat=False):
        super().__init__()
        self.repeat, self.scale_shape, self.flat = repeat, scale_shape, flat

    def forward(self, q, bits, scale):
        k = bits.view(torch.float8_e4m3fn).to(torch.bfloat16) * scale.view(*self.scale_shape)
        k = k.to(torch.float32)
        if self.repeat:
            b, h, n, d = k.shape
            k = k[:, :, None, :, :].expand(b, h, 2, n, d).reshape(b, 2 * h, n, d)
        if self.flat:
            return (q.flatten(0, 1) @ k.flatten(0, 1).transpose(1, 2)).softmax(-1)
        return F.scaled_dot_product_attention(q, k, k)


def _key(module, scale):
    q = torch.randn(1, 4 if module.repeat else 2, 2, 8)
    bits = torch.randn(1, 2, 5, 8).to(torch.float8_e4m3fn).view(torch.uint8)
    gm = capture_graphs(module, q, bits, scale.to(torch.bfloat16))[0].gm
    nodes = list(gm.graph.nodes)
    node = next((n for n in nodes if "scaled_dot_product" in str(n.target)), None)
    if node is not None:
        return node.args[1]
    return next(n for n in nodes if n.op == "call_method" and n.target == "flatten"
                and n.meta["example_value"].shape[-2] == 5)


def test_a_repeat_after_the_dequantization_is_recorded():
    found = fp8_cache_read(_key(_Read(repeat=True), torch.rand(2)))
    assert isinstance(found, FP8CacheRead)
    assert (found.fmt, found.repeat) == ("e4m3", 2) and found.scale.startswith("view")
    assert FP8_STORAGE[torch.float8_e5m2] == "e5m2"


def test_a_per_tensor_scale_is_a_cache_read():
    found = fp8_cache_read(_key(_Read(scale_shape=(1, 1, 1, 1)), torch.rand(1)))
    assert found is not None and (found.fmt, found.repeat) == ("e4m3", 1)


def test_a_per_channel_scale_or_a_flattened_operand_is_left_alone():
    # a scale per channel mixes values within a vector: not one scale per head
    assert fp8_cache_read(_key(_Read(scale_shape=(1, 1, 1, -1)), torch.rand(8))) is None
    # a 3-D operand (heads merged into the batch) is not of the recognized form
    assert fp8_cache_read(_key(_Read(flat=True), torch.rand(2))) is None
