"""geoscale_fx.runtime.key_norm_trust: when the running key-norm maximum covers a cache tensor, and
the re-measurement (``key_head_norms``) when it does not. A hand-built graph
``key = cat([past, new], 2)`` and the observed-keys estimator; no compile."""
from __future__ import annotations

import operator
import types

import torch
from torch.fx import Graph, GraphModule

from geoscale_fx.numerics.estimators import ExactObservedKeys, ExactSigma
from geoscale_fx.numerics.head_weights import key_head_norms
from geoscale_fx.runtime.key_norm_trust import KeyNormTrust
from geoscale_fx.sites.terms import Side, Source, Term
from geoscale_fx.runtime.version_record import VersionRecord

AXES = (1, 3)


def _query() -> Side:
    return Side(Source("rmsnorm", "norm", 8), "w", "linear", ((0, 1), (2, 3)))


def _keys() -> Side:
    return Side(Source("rmsnorm", "key", 2), None, "observed", ((0,), (1,)), observed_axes=AXES,
                observed_past=(("past", 1),), observed_fresh=(("new", 1),))


def _graph() -> GraphModule:
    g = Graph()
    past, new = g.placeholder("past"), g.placeholder("new")
    key = g.call_function(torch.cat, ([past, new], 2), name="key")
    g.output((key,))
    return GraphModule(torch.nn.Module(), g)


def _trust(estimator):
    plan = types.SimpleNamespace(policy=types.SimpleNamespace(estimators=[estimator]))
    state = types.SimpleNamespace(key_norm_max=torch.zeros(2))
    return KeyNormTrust(_graph(), [plan]), [state], state


def _cache(scale=1.0, seed=0):
    return torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(seed)) * scale


def test_an_unknown_cache_is_measured_and_replaces_the_running_maximum():
    trust, states, state = _trust(ExactObservedKeys(Term(_query(), _keys()), "", 1.0))
    assert len(trust.entries) == 1 and trust.entries[0].past == ((0, 1),)
    assert trust.entries[0].outputs == (0,)               # the graph's output stores the key
    state.key_norm_max.fill_(100.0)                        # from another cache: not trusted
    past = _cache()
    assert trust.before([past, _cache(seed=1)], states) == 1
    torch.testing.assert_close(state.key_norm_max, key_head_norms(past, AXES))


def test_what_the_graph_wrote_is_trusted_until_it_or_the_maximum_changes():
    trust, states, state = _trust(ExactObservedKeys(Term(_query(), _keys()), "", 1.0))
    past, new = _cache(), _cache(seed=1)
    trust.before([past, new], states)
    out = torch.cat([past, new], 2)
    state.key_norm_max.copy_(torch.maximum(state.key_norm_max, key_head_norms(new, AXES)))
    trust.after([past, new], (out,), states)
    kept = state.key_norm_max.clone()
    assert trust.before([out, _cache(seed=2)], states) == 0        # the cache it wrote
    assert trust.before([past, _cache(seed=2)], states) == 0       # and the one it read
    assert torch.equal(state.key_norm_max, kept)
    out.mul_(3.0)                                                   # edited in place
    assert trust.before([out, _cache(seed=2)], states) == 1
    torch.testing.assert_close(state.key_norm_max, key_head_norms(out, AXES))
    trust.after([out, new], (out,), states)
    state.key_norm_max.add_(1.0)                   # the maximum rewritten (a cold start)
    assert trust.before([out, new], states) == 1


def test_a_graph_without_incremental_keys_has_nothing_to_do():
    whole = Side(Source("rmsnorm", "key", 2), None, "observed", ((0,), (1,)), observed_axes=AXES)
    for estimator in (ExactObservedKeys(Term(_query(), whole), "", 1.0),
                      ExactSigma(Term(_query(), _query()), "", 1.0)):
        trust, states, state = _trust(estimator)
        assert trust.entries == [] and trust.before([_cache(), _cache()], states) == 0
        trust.after([_cache(), _cache()], (_cache(),), states)
        assert float(state.key_norm_max.sum()) == 0.0


def _static_trust():
    """As ``_trust``, for a graph that writes the cache in place and returns no key (a
    StaticCache): nothing stored, the next call's past is this call's."""
    g = Graph()
    past, new = g.placeholder("past"), g.placeholder("new")
    key = g.call_function(torch.cat, ([past, new], 2), name="key")
    g.output((g.call_function(torch.neg, (key,)),))
    plan = types.SimpleNamespace(policy=types.SimpleNamespace(
        estimators=[ExactObservedKeys(Term(_query(), _keys()), "", 1.0)]))
    state = types.SimpleNamespace(key_norm_max=torch.zeros(2))
    return KeyNormTrust(GraphModule(torch.nn.Module(), g), [plan]), [state], state


def _graph_call(trust, states, state, args, record, fast=False):
    """What the runtime does around one call, with the graph's in-place writes: the new
    keys into the cache's first slot, the running maximum raised to them."""
    runnings = trust.runnings(states)
    if not fast:
        trust.before(args, states)
    past, new = args
    with torch.no_grad():
        past[:, :, :1].copy_(new[:, :, :1])
        state.key_norm_max.copy_(torch.maximum(state.key_norm_max,
                                               key_head_norms(past, AXES)))
    out = (torch.cat([past, new], 2),)
    if fast:
        trust.recorded(args, out, runnings, record)
    else:
        record.update(trust.kept(args, out, runnings))
        trust.after(args, out, states, record)
    return out


def test_the_fast_check_holds_until_the_cache_or_the_maximum_changes():
    trust, states, state = _static_trust()
    assert trust.entries[0].outputs == () and trust.layout.next_call == (0, 1)
    record, past, new = VersionRecord(), _cache(), _cache(seed=1)
    args = [past, new]
    _graph_call(trust, states, state, args, record)
    runnings = trust.runnings(states)
    assert trust.holds(args, runnings, record)
    for _ in range(2):                                   # fast calls: the versions re-read
        _graph_call(trust, states, state, args, record, fast=True)
        assert trust.holds(args, runnings, record)
        assert trust.before(args, states) == 0           # and the owner still covers it
    past.mul_(5.0)                                       # the user edits the cache
    assert not trust.holds(args, runnings, record)
    _graph_call(trust, states, state, args, record)
    assert trust.holds(args, runnings, record)
    assert not trust.holds([past.clone(), new], runnings, record)   # another cache
    state.key_norm_max.add_(1.0)                         # another writer of the maximum
    assert not trust.holds(args, runnings, record)


def test_the_fast_check_follows_the_stored_keys_of_a_concatenating_graph():
    """A DynamicCache: the next call's past is the key this call returned; ``recorded``
    records it, and the call after that holds only for the new one."""
    trust, states, state = _trust(ExactObservedKeys(Term(_query(), _keys()), "", 1.0))
    record, runnings = VersionRecord(), trust.runnings(states)
    past = _cache()
    trust.before([past, _cache(seed=1)], states)
    out = (torch.cat([past, _cache(seed=1)], 2),)
    record.update(trust.kept([past, _cache(seed=1)], out, runnings))
    trust.after([past, _cache(seed=1)], out, states, record)
    args = [out[0], _cache(seed=2)]
    assert trust.holds(args, runnings, record) and not trust.holds([past, args[1]],
                                                                     runnings, record)
    out2 = (torch.cat(args, 2),)
    trust.recorded(args, out2, runnings, record)
    assert trust.holds([out2[0], _cache(seed=3)], runnings, record)
    assert not trust.holds(args, runnings, record)
    out2[0].mul_(2.0)                                    # edited after the call
    assert not trust.holds([out2[0], _cache(seed=3)], runnings, record)


def test_a_graph_without_incremental_keys_always_holds():
    trust, states, _ = _trust(ExactSigma(Term(_query(), _query()), "", 1.0))
    assert trust.holds([_cache(), _cache()], trust.runnings(states), VersionRecord())


def test_a_cache_with_keys_that_are_not_finite_is_counted_and_said_once(caplog):
    """Someone else's cache (its FP8 bits, or NaN activations) with NaN keys: the measured
    maximum is not finite; counted and warned, never silent."""
    from torch._dynamo.utils import counters

    counters["geoscale"].clear()
    trust, states, state = _trust(ExactObservedKeys(Term(_query(), _keys()), "", 1.0))
    past = _cache()
    past[0, 1, 2, 0] = float("nan")
    with caplog.at_level("WARNING", logger="geoscale_fx"):
        trust.before([past, _cache(seed=1)], states)
        trust.before([past.clone(), _cache(seed=1)], states)     # a new tensor: measured again
    assert counters["geoscale"]["nonfinite_cached_keys"] == 2
    assert bool(torch.isnan(state.key_norm_max[1])) and bool(torch.isfinite(state.key_norm_max[0]))
    said = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(said) == 1 and "1 key head(s)" in said[0]


def _gqa_trust(read):
    """A graph ``stored = cat([past, new], 2)`` (2 kv heads) returning ``stored``, whose
    attention key is ``read(graph, stored)`` (4 heads after GQA's ``repeat_kv``); example
    values on every node, as Dynamo leaves them."""
    g = Graph()
    past, new = g.placeholder("past"), g.placeholder("new")
    stored = g.call_function(torch.cat, ([past, new], 2), name="keys")
    key = read(g, stored)
    g.output((stored, g.call_function(torch.neg, (key,))))
    values = {"past": _cache(), "new": _cache(seed=1)}
    for node in g.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = values[node.name]
        elif node.op != "output":
            args = torch.fx.node.map_arg(node.args, lambda n: n.meta["example_value"])
            fn = node.target if node.op == "call_function" else \
                (lambda t, *a, _m=node.target: getattr(t, _m)(*a))
            node.meta["example_value"] = fn(*args)
    side = Side(Source("rmsnorm", key.name, 2), None, "observed", ((0,), (1,)),
                observed_axes=AXES, observed_past=(("past", 2),),
                observed_fresh=(("new", 2),))
    plan = types.SimpleNamespace(policy=types.SimpleNamespace(
        estimators=[ExactObservedKeys(Term(_query(), side), "", 1.0)]))
    state = types.SimpleNamespace(key_norm_max=torch.zeros(4))
    return KeyNormTrust(GraphModule(torch.nn.Module(), g), [plan]), [state], state


def _repeat_kv(g, x, length=10):
    """transformers' ``repeat_kv`` (n_rep = 2) on a ``(1, 2, length, 4)`` key."""
    wide = g.call_function(operator.getitem, (x, (slice(None), slice(None), None,
                                                  slice(None), slice(None))))
    wide = g.call_method("expand", (wide, 1, 2, 2, length, 4))
    return g.call_method("reshape", (wide, 1, 4, length, 4))


def test_the_stored_keys_are_found_under_a_gqa_head_repeat():
    """transformers passes SDPA a mask (under torch 2.11's compile, always; on any release
    with an ``attention_mask``) and then repeats the kv heads itself: the DynamicCache keeps
    the ``cat``, the attention reads ``repeat_kv(cat)``. Every entry of the ``cat`` is in the
    key, so the running maximum covers it (read with the repeat): it is stored, and the next
    call, whose past it is, is trusted without measuring."""
    trust, states, state = _gqa_trust(_repeat_kv)
    assert trust.entries[0].outputs == (0,) and trust.layout.next_call == (0, 2)
    record, runnings = VersionRecord(), trust.runnings(states)
    past, new = _cache(), _cache(seed=1)
    assert trust.before([past, new], states) == 1                # a fresh cache: measured
    stored = torch.cat([past, new], 2)
    with torch.no_grad():                                        # what the graph does
        state.key_norm_max.copy_(torch.maximum(
            state.key_norm_max, key_head_norms(new, AXES).repeat_interleave(2)))
    out = (stored, torch.zeros(1))
    record.update(trust.kept([past, new], out, runnings))
    trust.after([past, new], out, states, record)
    # independent reference: per kv head over the whole stored cache, repeated per query head
    truth = torch.linalg.vector_norm(stored, dim=3).amax(dim=(0, 2)).repeat_interleave(2)
    torch.testing.assert_close(state.key_norm_max, truth)
    args = [stored, _cache(seed=2)]
    assert trust.holds(args, runnings, record)                   # fast path for the next call
    assert trust.before(args, states) == 0
    stored.mul_(3.0)                                             # edited: measured again
    assert not trust.holds(args, runnings, record)
    assert trust.before(args, states) == 1
    torch.testing.assert_close(state.key_norm_max, 3.0 * truth)


def test_a_key_that_reads_a_slice_of_the_returned_cache_does_not_store_it():
    """A window of the returned cache (``cat[:, :, -4:]``), then repeated: the key misses the
    older entries, the running maximum may not cover them; nothing stored, no fast path."""
    def window(g, x):
        part = g.call_function(operator.getitem, (x, (slice(None), slice(None),
                                                      slice(-6, None))))
        return _repeat_kv(g, part, 6)

    trust, _, _ = _gqa_trust(window)
    assert trust.entries[0].outputs == () and trust.layout.next_call == (0, 1)
