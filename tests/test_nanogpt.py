"""models_zoo.nanogpt's KV cache: the same logits and tokens as recomputing the whole sequence."""
import pytest
import torch

from models_zoo.nanogpt import GPT, GPTConfig

IMPLS = ("sdpa", "explicit")


def _model(impl: str, block_size: int = 32, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=64, block_size=block_size, n_layer=2, n_head=4, n_embd=32,
                       attn_impl=impl)
    return GPT(config).eval()


@pytest.mark.parametrize("impl", IMPLS)
def test_cached_logits_equal_the_full_forward(impl):
    """Prefill 6 tokens, a chunk of 3 (a past and several queries: the mask is offset), then
    one token at a time: every position's logits equal those of one uncached forward."""
    model = _model(impl)
    idx = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)                                   # (2, 14, 64)
        parts, cache = [], None
        for start, stop in [(0, 6), (6, 9)] + [(t, t + 1) for t in range(9, 14)]:
            logits, loss, cache = model(idx[:, start:stop], past_key_values=cache,
                                        use_cache=True)
            assert loss is None and len(cache) == 2
            assert cache[0][0].shape == (2, 4, stop, 8) == cache[1][1].shape
            parts.append(logits)
    cached = torch.cat(parts, dim=1)
    assert cached.shape == full.shape
    assert (cached - full).abs().max().item() < 1e-5
    assert full[:, 1:].sub(full[:, :-1]).abs().max() > 1e-3    # positions differ: not trivial


@pytest.mark.parametrize("impl", IMPLS)
def test_a_chunk_without_its_past_is_seen(impl):
    """The check above can fail: the same chunk without its past (positions and keys lost)
    is far beyond 1e-5 from the full forward, with its past within."""
    model = _model(impl)
    idx = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(idx)
        _, _, cache = model(idx[:, :6], use_cache=True)
        with_past, _, _ = model(idx[:, 6:], past_key_values=cache, use_cache=True)
        without, _ = model(idx[:, 6:])
    assert (with_past - full[:, 6:]).abs().max().item() < 1e-5
    assert (without - full[:, 6:]).abs().max().item() > 1e-3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("do_sample", [False, True])
def test_cached_generate_gives_the_uncached_tokens(impl, do_sample):
    """Greedy and sampled (same generator seed) generation, across block_size (the cache is
    dropped and the cropped context recomputed, as without a cache)."""
    model = _model(impl, block_size=16)
    prompt = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(3))

    def run(use_cache):
        return model.generate(prompt, 20, do_sample=do_sample, use_cache=use_cache,
                              generator=torch.Generator().manual_seed(4))

    plain, cached = run(False), run(True)
    assert plain.shape == (3, 25)
    assert torch.equal(cached, plain)
    assert torch.equal(plain[:, :5], prompt)


def test_the_cache_is_the_only_route_past_block_size():
    """A sequence longer than block_size is refused with the lengths named, cache or not."""
    model = _model("sdpa", block_size=8)
    with torch.no_grad():
        _, _, cache = model(torch.zeros(1, 6, dtype=torch.long), use_cache=True)
        with pytest.raises(ValueError, match=r"past 6 \+ 3\) > block_size 8"):
            model(torch.zeros(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)


def test_without_use_cache_the_return_contract_is_unchanged():
    model = _model("explicit")
    idx = torch.randint(0, 64, (2, 7))
    out = model(idx, targets=idx)
    assert len(out) == 2 and out[0].shape == (2, 7, 64) and out[1].ndim == 0
