"""geoscale_fx.runtime.key_trust_protocol: the record's layout per entry, and ``KeyNormTrust``
as the ``KeyTrust`` the runtime calls — every member the runtime reads is in the protocol,
with the implementation's parameters, and ``kept`` puts each tensor in the layout's slot."""
from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import torch

from geoscale_fx.numerics.estimators import ExactObservedKeys
from geoscale_fx.runtime import graph_runtime, key_norm_trust
from geoscale_fx.runtime.key_norm_trust import KeyNormTrust
from geoscale_fx.runtime.key_trust_protocol import KeyTrust, RecordLayout
from geoscale_fx.runtime.version_record import VersionRecord
from geoscale_fx.sites.terms import Term
from tests.runtime.test_key_norm_trust import _cache, _keys, _query, _static_trust, _trust


def test_layouts_of_dynamic_static_and_mixed_entries():
    dynamic = RecordLayout.of(past=(1, 1), stored=(1, 1))
    assert (dynamic.running, dynamic.past, dynamic.stored) == ((0, 1), ((2,), (3,)), ((4,), (5,)))
    assert dynamic.next_call == (0, 1, 4, 5) and dynamic.size == 6
    assert dynamic.caches(1) == (3, 5)
    static = RecordLayout.of(past=(1, 2), stored=(0, 0))
    assert static.past == ((2,), (3, 4)) and static.stored == ((), ())
    assert static.next_call == (0, 1, 2, 3, 4) and static.size == 5
    mixed = RecordLayout.of(past=(1, 1), stored=(0, 1))
    assert mixed.next_call == (0, 1, 2, 4)           # the first continues in place
    assert RecordLayout.of(past=(2,), stored=(1,)).next_call is None   # no one-to-one
    empty = RecordLayout.of(past=(), stored=())
    assert empty.next_call == () and empty.size == 0


def _read_from_key_trust(tree: ast.AST) -> set[str]:
    """The attribute names the runtime reads from its key trust: ``self.key_trust.X``, and
    ``X`` of any local bound to ``self.key_trust`` (``trust = self.key_trust``)."""
    def is_key_trust(node):
        return isinstance(node, ast.Attribute) and node.attr == "key_trust"

    read = set()
    for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        aliases = set()
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = zip(target.elts, node.value.elts) if isinstance(
                        target, ast.Tuple) and isinstance(node.value, ast.Tuple) else \
                        [(target, node.value)]
                    aliases |= {t.id for t, v in pairs
                                if isinstance(t, ast.Name) and is_key_trust(v)}
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and (is_key_trust(node.value) or (
                    isinstance(node.value, ast.Name) and node.value.id in aliases)):
                read.add(node.attr)
    return read


def _members() -> set[str]:
    return {n for n in vars(KeyTrust) if not n.startswith("_")} | set(
        KeyTrust.__annotations__)


def test_the_runtime_reads_only_what_the_protocol_names():
    read = _read_from_key_trust(ast.parse(Path(graph_runtime.__file__).read_text()))
    assert read == {"entries", "runnings", "holds", "recorded", "before", "kept", "after"}
    assert read <= _members()
    assert _members() - read == {"layout"}          # for the record's readers and the tests


def test_key_norm_trust_is_a_key_trust_with_the_protocol_parameters():
    trust, _, _ = _trust(ExactObservedKeys(Term(_query(), _keys()), "", 1.0))
    assert isinstance(trust, KeyTrust) and isinstance(trust.layout, RecordLayout)
    assert not isinstance(types.SimpleNamespace(entries=[]), KeyTrust)
    for name in _members() - set(KeyTrust.__annotations__):
        expected = list(inspect.signature(getattr(KeyTrust, name)).parameters)
        assert list(inspect.signature(getattr(KeyNormTrust, name)).parameters) == expected


def test_kept_puts_each_tensor_in_its_layout_slot():
    """A concatenating graph (a DynamicCache) and one writing in place (a StaticCache): the
    running maximum, the past cache and the stored key where ``layout`` says; ``after``
    makes the owner cover exactly the layout's cache slots."""
    for trust, states, state in (_trust(ExactObservedKeys(Term(_query(), _keys()), "", 1.0)),
                                 _static_trust()):
        past, new = _cache(), _cache(seed=1)
        out = (torch.cat([past, new], 2),)
        record = VersionRecord()
        record.update(trust.kept([past, new], out, trust.runnings(states)))
        layout = trust.layout
        assert len(record.refs) == layout.size
        assert record.refs[layout.running[0]]() is state.key_norm_max
        assert record.refs[layout.past[0][0]]() is past
        stored = [record.refs[s]() for s in layout.stored[0]]
        if trust.entries[0].outputs:
            assert len(stored) == 1 and stored[0] is out[0]
        else:
            assert stored == []
        trust.after([past, new], out, states, record)
        owner = key_norm_trust._OWNERS[id(state.key_norm_max)]
        assert owner.record() is record and owner.running == layout.running[0]
        assert owner.caches == layout.caches(0)
        assert trust.holds([out[0] if stored else past, new], trust.runnings(states), record)
