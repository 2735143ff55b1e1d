"""Incremental cached keys (issue 19): O(new tokens) per decode step, the bound still certified.

``analysis.forms.cached_keys`` splits a decode step's keys into past cache tensors and this call's new
keys; the graph measures only the new ones and keeps a running maximum, which
``key_norm_trust`` trusts only for caches the graph wrote itself. Checked here against an
independent recomputation of ``max_j ‖k_g,j‖`` over the whole cache (torch.linalg on the
cache's contents) after every call:

* the analysis finds the decomposition for HF's DynamicCache (``cat``) and StaticCache
  (``index_copy_`` into the placeholder), and refuses a cache whose entries are scaled;
* in a greedy decode loop the cache is measured on the host once (the prefill of a new
  cache), and the running maximum equals the cache's true maximum at every step;
* a cache edited between calls (keys ×100), a second cache used alternately with the first,
  and a beam-style reorder are re-measured: the running maximum is never below the truth.
"""
from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph, GraphModule

import geoscale_fx
from geoscale_fx.numerics.head_weights import key_head_norms
from geoscale_fx.analysis.forms.cached_keys import key_sources, repeated_kv_heads
from geoscale_fx.analysis.fx.graph_ops import ValueKinds
from tests.hf_models import build_hf
from tests.test_decode import _runtimes

pytestmark = pytest.mark.zoo
COMPILER = "eager"
AXES = (-3, -1)


# --------------------------------------------------------------------------------------
# analysis on hand-made graphs
# --------------------------------------------------------------------------------------

def _graph(body):
    """A graph ``sdpa(q, key, key)`` where ``key = body(graph, past, new)``; example values
    (B=2, H=2, L, d_h=8) on every node."""
    graph = Graph()
    q = graph.placeholder("q")
    past = graph.placeholder("past")
    new = graph.placeholder("new_in")
    new_k = graph.call_function(torch.mul, (new, 2.0))           # "this call's keys"
    key = body(graph, past, new_k)
    sdpa = graph.call_function(torch.nn.functional.scaled_dot_product_attention,
                               (q, key, key))
    graph.output(sdpa)
    values = {"q": torch.zeros(2, 2, 1, 8), "past": torch.zeros(2, 2, 5, 8),
              "new_in": torch.zeros(2, 2, 1, 8)}
    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = values[node.name]
        elif node.op != "output":
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            target = node.target if node.op == "call_function" else \
                (lambda t, *a, _m=node.target: getattr(t, _m)(*a))
            env[node] = target(*args)
        node.meta["example_value"] = env.get(node)
    return graph, key, sdpa


def _sources(body):
    graph, key, sdpa = _graph(body)
    kinds = ValueKinds(graph, [torch.zeros(1)] * 3)
    return key_sources(key, sdpa, kinds)


def test_a_concatenated_cache_is_past_plus_fresh():
    sources = _sources(lambda g, past, new: g.call_function(torch.cat, ([past, new], 2)))
    assert sources.past == (("past", 1),) and sources.fresh == (("mul", 1),)


def test_a_whole_vector_slice_of_the_concatenation_keeps_the_decomposition():
    def body(g, past, new):
        cat = g.call_function(torch.cat, ([past, new], -2))
        return g.call_function(operator.getitem, (cat, (slice(None), slice(None),
                                                        slice(-4, None))))
    assert _sources(body).past == (("past", 1),)


def test_a_write_at_positions_into_the_cache_is_fresh():
    def body(g, past, new):
        g.call_method("index_copy_", (past, 2, g.call_function(torch.arange, (1,)), new))
        return past
    sources = _sources(body)
    assert sources.past == (("past", 1),) and sources.fresh == (("mul", 1),)


@pytest.mark.parametrize("name, body", [
    ("scaled past", lambda g, past, new: g.call_function(
        torch.cat, ([g.call_function(torch.mul, (past, 3.0)), new], 2))),
    ("cat along channels", lambda g, past, new: g.call_function(
        operator.getitem, (g.call_function(torch.cat, ([past, past], 3)),
                           (slice(None), slice(None), slice(None), slice(0, 8))))),
    ("in-place scale of the cache", lambda g, past, new: (
        g.call_method("mul_", (past, 3.0)), g.call_function(torch.cat, ([past, new], 2)))[1]),
])
def test_what_is_not_only_moved_is_not_incremental(name, body):
    """Entries that are not moved whole from the past cache: no decomposition (the whole
    key is measured every step), never a running maximum that could miss them."""
    assert _sources(body) is None, name


# --------------------------------------------------------------------------------------
# decode loops against the cache's true maxima
# --------------------------------------------------------------------------------------

def _cache(model, kind: str, length: int = 24):
    import transformers

    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=length)
    return transformers.DynamicCache(config=model.config)


def _step(wrapped, kv, tokens, position, kind):
    kwargs = dict(input_ids=tokens, past_key_values=kv, use_cache=True)
    if kind == "static":
        kwargs["cache_position"] = torch.arange(position, position + tokens.shape[1])
    with torch.no_grad():
        return wrapped(**kwargs).logits


def _running_and_truth(wrapped, kv) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (the state's running maximum, max ‖k‖ per kv head over the cache)."""
    out = []
    for layer, record in zip(kv.layers, wrapped.geoscale.records.values()):
        running = record.state.key_norm_max
        truth = key_head_norms(layer.keys, AXES)        # per kv head; the site's key heads
        truth = truth.repeat_interleave(running.numel() // truth.numel())   # after repeat_kv
        out.append((running.clone(), truth))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_decode_measures_only_new_keys_and_tracks_the_true_maximum(family, kind):
    model = build_hf(f"{family}-sdpa")
    wrapped = geoscale_fx.wrap(model, compiler=COMPILER)
    kv = _cache(model, kind)
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    logits = _step(wrapped, kv, ids, 0, kind)
    for t in range(6):
        nxt = logits[:, -1:].argmax(-1)
        logits = _step(wrapped, kv, nxt, 6 + t, kind)
        for running, truth in _running_and_truth(wrapped, kv):
            # the running maximum covers the cache, and is exact (nothing ever left it)
            torch.testing.assert_close(running, truth, rtol=1e-6, atol=1e-6)
    decode_sites = [r.site for r in wrapped.geoscale.records.values()]
    assert all(s.k.incremental for s in decode_sites if s.cached_keys)
    assert any(s.cached_keys for s in decode_sites)
    runtimes = _runtimes(wrapped)
    # measured on the host once per graph at most: a static cache's prefill (a fresh cache);
    # every decode step is trusted
    assert sum(r.remeasured_caches for r in runtimes) <= len(kv.layers)
    decode = [r for r in runtimes if r.key_trust.entries]
    assert sum(r.full_steps + r.reused_steps for r in decode) >= 6   # every decode call


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_the_runtime_record_is_laid_out_as_the_trust_says(kind):
    """After decode steps, the decode graph's record (its ``GraphRuntime`` binding's) holds
    the running maxima in the trust's ``layout.running`` slots and the cache's key tensors in
    its ``stored`` slots (a DynamicCache: the keys the graph returned) or ``past`` slots (a
    StaticCache: the placeholders it wrote in place)."""
    model = build_hf("llama-sdpa")
    wrapped = geoscale_fx.wrap(model, compiler=COMPILER)
    kv = _cache(model, kind)
    logits = _step(wrapped, kv, torch.randint(1, 128, (2, 6)), 0, kind)
    for t in range(3):
        logits = _step(wrapped, kv, logits[:, -1:].argmax(-1), 6 + t, kind)
    keys = {id(layer.keys) for layer in kv.layers}
    laid_out = []
    for runtime in _runtimes(wrapped):
        layout = runtime.key_trust.layout
        for binding in [runtime._own, *runtime.bound.values()]:
            record = binding.record
            if not (runtime.key_trust.entries and record.valid):
                continue
            running = [record.refs[s]() for s in layout.running]
            assert len(running) == len(binding.runnings) and all(
                a is b for a, b in zip(running, binding.runnings))
            caches = layout.stored if kind == "dynamic" else layout.past
            laid_out.append({id(record.refs[s]()) for slots in caches for s in slots})
    assert keys in laid_out, (keys, laid_out)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_an_edited_or_alternated_cache_is_remeasured_never_under_bounded(kind):
    model = build_hf("llama-sdpa")
    wrapped = geoscale_fx.wrap(model, compiler=COMPILER)
    a, b = _cache(model, kind), _cache(model, kind)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 128, (2, 5), generator=gen)
    _step(wrapped, a, ids, 0, kind)
    _step(wrapped, b, ids[:, :3], 0, kind)
    positions = {id(a): 5, id(b): 3}

    def decode(kv):
        _step(wrapped, kv, torch.randint(1, 128, (2, 1), generator=gen), positions[id(kv)],
              kind)
        positions[id(kv)] += 1
        for running, truth in _running_and_truth(wrapped, kv):
            assert bool((running >= truth * (1 - 1e-6)).all()), (running, truth)

    before = sum(r.remeasured_caches for r in _runtimes(wrapped))
    decode(a)                       # b was used last: a is not covered, re-measured
    decode(a)                       # trusted
    with torch.no_grad():           # the user edits a's keys between calls
        for layer in a.layers:
            layer.keys.mul_(100)
    decode(a)                       # re-measured: ×100 seen
    decode(b)
    for layer in a.layers:          # a beam-style reorder: a new tensor for the keys
        layer.keys = layer.keys.index_select(0, torch.tensor([1, 0]))
    decode(a)
    after = sum(r.remeasured_caches for r in _runtimes(wrapped))
    n_layers = len(a.layers)
    assert after - before == 4 * n_layers    # every decode above but the second, every layer


def test_a_masked_gqa_decode_trusts_the_keys_it_returned():
    """With an ``attention_mask`` transformers passes SDPA a mask and repeats the kv heads
    itself (``repeat_kv``; torch 2.11's Dynamo folds ``torch.compiler.is_exporting()`` to
    True, so there transformers always does): the DynamicCache keeps the ``cat``, the
    attention reads its repeat. The decode is still measured once (the prefill's fresh
    cache), the running maximum equals the cache's true one, and the record holds the
    returned keys in its ``stored`` slots."""
    model = build_hf("llama-sdpa")
    wrapped = geoscale_fx.wrap(model, compiler=COMPILER)
    kv = _cache(model, "dynamic")
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad():
        logits = wrapped(input_ids=ids, past_key_values=kv, attention_mask=mask).logits
        for _ in range(4):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            logits = wrapped(input_ids=logits[:, -1:].argmax(-1), past_key_values=kv,
                             attention_mask=mask).logits
            for running, truth in _running_and_truth(wrapped, kv):
                torch.testing.assert_close(running, truth, rtol=1e-6, atol=1e-6)
    decode = [r for r in _runtimes(wrapped) if r.key_trust.entries]
    sdpa = [n for r in decode for n in r.gm.graph.nodes
            if n.target is torch._C._nn.scaled_dot_product_attention]
    assert sdpa and all(repeated_kv_heads(n.args[1]) is not None for n in sdpa)  # the form
    assert sum(r.remeasured_caches for r in _runtimes(wrapped)) <= len(kv.layers)
    keys = {id(layer.keys) for layer in kv.layers}
    laid_out = [{id(b.record.refs[s]()) for slots in r.key_trust.layout.stored for s in slots}
                for r in decode for b in [r._own, *r.bound.values()] if b.record.valid]
    assert keys in laid_out, (keys, laid_out)
