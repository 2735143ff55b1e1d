"""geoscale_fx.key_norm_trust: when the running key-norm maximum covers a cache tensor, and
the re-measurement (``key_head_norms``) when it does not. A hand-built graph
``key = cat([past, new], 2)`` and the observed-keys estimator; no compile."""
from __future__ import annotations

import types

import torch
from torch.fx import Graph, GraphModule

from geoscale_fx.estimators import ExactObservedKeys, ExactSigma
from geoscale_fx.head_weights import key_head_norms
from geoscale_fx.key_norm_trust import KeyNormTrust
from geoscale_fx.site_terms import Side, Source, Term

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
