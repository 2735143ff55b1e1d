"""A decode step's growing lengths are marked dynamic before its first compile: a generate
compiles the prefill and one decode graph, not a static decode graph first."""
from __future__ import annotations

import pytest
import torch

import geoscale_fx
from geoscale_fx.compile.attach import geoscale_call
from geoscale_fx.compile.decode_lengths import DecodeLengths
from tests.hf_models import build_hf

transformers = pytest.importorskip("transformers")


def _marked(t: torch.Tensor) -> set:
    return set(getattr(t, "_dynamo_weak_dynamic_indices", ()))


def _filled(cache, layers: int, length: int):
    for i in range(layers):
        cache.update(torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16), i)
    return cache


def test_a_cache_with_tokens_has_its_growing_lengths_marked_once():
    model = build_hf("llama-sdpa")
    lengths = DecodeLengths()
    empty = transformers.DynamicCache(config=model.config)
    assert not lengths.mark(dict(cache=empty, attention_mask=torch.ones(1, 5)))
    cache = _filled(transformers.DynamicCache(config=model.config), 2, 5)
    mask = torch.ones(1, 6)
    assert lengths.mark(dict(input_ids=torch.ones(1, 1, dtype=torch.long), cache=cache,
                             attention_mask=mask))
    assert all(_marked(layer.keys) == _marked(layer.values) == {2} for layer in cache.layers)
    assert _marked(mask) == {1}
    # the same cache at its next step: nothing more to mark (the graph is symbolic already)
    later = torch.ones(1, 7)
    assert not lengths.mark(dict(cache=cache, attention_mask=later)) and not _marked(later)
    assert lengths.marked == 1


def test_static_storage_is_left_static():
    model = build_hf("llama-sdpa")
    cache = _filled(transformers.StaticCache(config=model.config, max_cache_len=16), 2, 5)
    mask = torch.ones(1, 6)
    assert DecodeLengths().mark(dict(past_key_values=cache, attention_mask=mask))
    assert all(not _marked(layer.keys) for layer in cache.layers)
    assert _marked(mask) == {1}                      # the mask still grows by a token a step


@pytest.mark.slow                 # decoding end to end (the unit tests above stay fast)
def test_generate_compiles_the_prefill_and_one_decode_graph():
    """Three decode steps after the prefill: two compiles (Dynamo alone compiles a static
    first decode step, then the symbolic one); eager's tokens; a new prompt length compiles
    the prefill again and reuses the decode graph."""
    model = build_hf("llama-sdpa")
    ids = torch.randint(0, 128, (1, 4))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    geoscale_fx.apply_(model, compiler="eager")
    call = geoscale_call(model)
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, expected)
    assert call.backend.compiles == 2 and call.decode_lengths.marked == 1
    model.generate(torch.randint(0, 128, (1, 7)), max_new_tokens=4, do_sample=False)
    assert call.backend.compiles == 3 and call.eager_calls == 0


@pytest.mark.slow
def test_the_bench_counts_three_plain_compiles_and_two_of_ours():
    """``python -m bench.generate_compiles``: plain ``torch.compile`` compiles a static decode
    graph before the symbolic one, the converted model does not; the same tokens."""
    from bench.generate_compiles import measure

    plain, plain_tokens = measure("plain", "eager", new=3)
    ours, our_tokens = measure("apply_", "eager", new=3)
    assert (plain["first compiles"], ours["first compiles"]) == (3, 2)
    assert plain["second compiles"] == ours["second compiles"] == 1
    assert all(torch.equal(a, b) for a, b in zip(plain_tokens, our_tokens))
