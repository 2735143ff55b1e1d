"""export.fp8_weights: block-scaled FP8 weights read as the values the model computes with."""
from __future__ import annotations

import doctest

import pytest
import torch

from geoscale_fx.export import fp8_weights
from geoscale_fx.export.fp8_weights import block_size, dequantize, scale_name


def _blocks(rows: int, cols: int, block=(4, 4)):
    gen = torch.Generator().manual_seed(0)
    bits = (torch.randn(rows, cols, generator=gen) * 100).to(torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    return bits, torch.rand(grid, generator=gen) + 0.1


@pytest.mark.parametrize("shape", [(8, 12), (10, 7), (3, 4)])   # ragged last blocks too
def test_each_entry_takes_its_blocks_scale(shape):
    bits, scale = _blocks(*shape)
    got = dequantize(bits, scale, (4, 4))
    for i in range(shape[0]):
        for j in range(shape[1]):
            assert got[i, j] == bits[i, j].float() * scale[i // 4, j // 4]
    assert got.dtype is torch.float32
    assert torch.equal(dequantize(bits, torch.tensor(0.5)), bits.float() * 0.5)   # per tensor


def test_equal_to_what_transformers_dequantizes_on_load():
    integration = pytest.importorskip("transformers.integrations.finegrained_fp8")
    bits, scale = _blocks(256, 384, (128, 128))
    theirs = integration.Fp8Dequantize(None)._dequantize_one(bits, scale, torch.bfloat16)
    assert torch.equal(dequantize(bits, scale, (128, 128)).to(torch.bfloat16), theirs)
    assert torch.equal(dequantize(bits, scale).to(torch.bfloat16), theirs)  # inferred blocks


def test_a_grid_that_does_not_tile_the_weight_is_refused_by_name():
    bits, scale = _blocks(10, 7)
    with pytest.raises(ValueError, match=r"'w' of shape \(10, 7\) has scales 'w_scale_inv' "
                                         r"on a \(3, 2\) grid; blocks of \[8, 8\] make a "
                                         r"\(2, 1\) grid"):
        dequantize(bits, scale, (8, 8), name="w")
    with pytest.raises(ValueError, match="not divisible by the grid of its scales"):
        dequantize(bits, scale, name="w")


def test_names_and_the_block_of_a_config():
    class Config:
        quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 64]}

    assert scale_name("a.weight") == "a.weight_scale_inv"
    assert block_size(Config()) == (128, 64) and block_size(object()) is None
    assert doctest.testmod(fp8_weights).failed == 0
