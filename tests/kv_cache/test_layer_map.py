"""``geoscale_fx.kv_cache.layer_map``: cache writes grouped into cache layers, on plain data.

Sites and writes are built by hand (``AttentionSite``/``CacheWrite`` are plain data); the
bounds are given tensors, so every combination is checked against an explicit maximum.
The refusals name the cache layer and the attentions involved.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from geoscale_fx.kv_cache.layer_map import (
    cache_layers, layer_scales, plan_cache_layers, traced_with_writes,
)
from geoscale_fx.kv_cache.refusals import LayerRefusal
from geoscale_fx.sites.model import AttentionSite, CacheWrite
from geoscale_fx.sites.terms import Side, Source

#: the values' side of a site whose values were traced to their projection
VALUE = Side(Source("rmsnorm", "norm", 8), "w", "linear", ((0, 1),))


def _site(name: str, index: int = 0, **kw) -> AttentionSite:
    kw = {"supported": True, "value": VALUE, **kw}
    return AttentionSite(name=name, index=index, kind="sdpa", node=f"sdpa_{index}", **kw)


def _write(layer: int, site: str, **kw) -> CacheWrite:
    return CacheWrite(layer=layer, node=f"cache_write_{layer}", module=site, site=site, **kw)


def _t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_a_hybrid_has_layers_only_where_attention_writes():
    """Cache layers 1 and 3 written (0 and 2 are linear attention): two layers, in order."""
    sites = [_site("model.layers.3.attn", 1), _site("model.layers.1.attn", 0)]
    writes = [_write(3, "model.layers.3.attn"), _write(1, "model.layers.1.attn")]
    layers = cache_layers(nn.Module(), sites, writes, "test")
    assert [(l.layer, l.site) for l in layers] == [(1, "model.layers.1.attn"),
                                                   (3, "model.layers.3.attn")]
    assert [l.sites for l in layers] == [(sites[1],), (sites[0],)]


def test_layer_bounds_are_the_max_over_its_parts_and_keep_the_latent_flag():
    """A differential attention: two calls (sites) of one name read one write: the queries'
    bound is their elementwise max; two writes of a layer: the stored bounds' max."""
    sites = [_site("a", 0), _site("a", 1)]
    writes = [_write(0, "a", latent=True), _write(0, "a")]
    (layer,) = cache_layers(nn.Module(), sites, writes, "test")
    q = {sites[0].index: _t(1, 5), sites[1].index: _t(3, 2)}
    kv = {0: {"k": _t(2.0), "v": _t(7.0)}, 1: {"k": _t(4.0), "v": _t(1.0)}}
    out = layer_scales(layer, lambda s: q[s.index], lambda w: kv[writes.index(w)], "test")
    assert torch.equal(out.q_bound, _t(3, 5)) and out.latent
    assert torch.equal(out.k_bound, _t(4.0)) and torch.equal(out.v_bound, _t(7.0))
    with pytest.raises(ValueError, match=r"cache layer 0 \('a'\): its stored key bounds have "
                                         r"differing head counts \[\(1,\), \(2,\)\]"):
        layer_scales(layer, lambda s: q[s.index],
                     lambda w: {"k": _t(1.0) if w is writes[0] else _t(1, 2), "v": _t(1.0)},
                     "test")
    with pytest.raises(ValueError, match="not finite"):
        layer_scales(layer, lambda s: _t(float("inf")), lambda w: kv[0], "test")


def test_an_attention_reusing_a_layers_cache_takes_its_kv_bounds_with_its_own_queries():
    """KV sharing: ``b`` reads what ``a`` stored in layer 0 and writes nothing."""
    a, b = _site("a", 0), _site("b", 1)
    (layer,) = cache_layers(nn.Module(), [a, b], [_write(0, "a", readers=("b",))], "test")
    assert layer.sites == (a,) and layer.readers == (b,)
    q = {0: _t(1.0, 2.0), 1: _t(7.0, 3.0)}
    out = layer_scales(layer, lambda s: q[s.index], lambda w: {"k": _t(4.0), "v": _t(5.0)},
                       "test")
    assert torch.equal(out.q_bound, q[0]) and out.readers[0][0] == "b"
    assert torch.equal(out.readers[0][1], q[1])


def test_refusals_name_the_layer_and_a_remedy():
    a, b = _site("a", 0), _site("b", 1)
    unowned = CacheWrite(2, "w", module="m", reason="no attention found in the model that "
                                                    "wrote it")
    with pytest.raises(ValueError, match=r"test: cache layer 2 \(`m`\): no attention found "
                                         r"in the model that wrote it\. The attention reading "
                                         r"this cache layer was not recognized"):
        cache_layers(nn.Module(), [a], [unowned], "test")
    with pytest.raises(ValueError, match=r"cache layer 0 \(`a`\): it is written by the "
                                         r"attentions \['a', 'b'\].*\. Several attention "
                                         "modules write one cache layer index"):
        cache_layers(nn.Module(), [a, b], [_write(0, "a"), _write(0, "b")], "test")
    with pytest.raises(ValueError, match=r"the attention 'a' \(1 call\(s\) in the trace\) "
                                         r"would read cache layers \[0, 1\]: an attention "
                                         r"writing some of them was not found\. The attention "
                                         r"reading this cache layer was not recognized.* \(1 "
                                         r"more refused\.\)$"):
        cache_layers(nn.Module(), [a], [_write(0, "a"), _write(1, "a")], "test")


def test_a_refused_layer_keeps_its_index_and_the_others_theirs():
    """Cache layers 0, 2 and 3 written (1: linear attention); 2's attention is refused, 3's
    write cannot be bounded: the plan keeps 0 under its own index and refuses 2 and 3, each
    for its own reason, before any bound is evaluated."""
    sites = [_site("l0", 0), _site("l2", 1, supported=False, reason="no normalization before "
                                    "the projection `q`: reached `add` (add)"), _site("l3", 2)]
    writes = [_write(0, "l0"), _write(2, "l2"),
              _write(3, "l3", reason="the stored values `v` cannot be bounded from the "
                                     "weights (the values `v` mixes tokens within a head "
                                     "vector)")]
    plan = plan_cache_layers(nn.Module(), sites, writes, "test")
    assert [(l.layer, l.site) for l in plan.layers] == [(0, "l0")]
    assert [(r.layer, r.site) for r in plan.refused] == [(2, "l2"), (3, "l3")]
    assert plan.refused[0].reason == ("the attention cannot be bounded from the weights (no "
                                      "normalization before the projection `q`: reached "
                                      "`add` (add))")
    assert "LayerNorm or RMSNorm precedes the projection" in plan.refused[0].remedy
    assert "mixed over positions" in plan.refused[1].remedy
    with pytest.raises(ValueError, match=r"^test: cache layer 2 \(`l2`\).*\(1 more refused"):
        plan.settle("test", partial=False)


def test_partial_settles_with_a_warning_unless_no_layer_is_left(caplog):
    refused = (LayerRefusal(2, "l2", "the attention cannot be bounded from the weights (x)"),)
    plan = plan_cache_layers(nn.Module(), [_site("l0", 0)], [_write(0, "l0")], "test")
    with caplog.at_level(logging.WARNING, logger="geoscale_fx"):
        type(plan)(plan.layers, refused).settle("test", partial=True)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "1 of 2 cache layers left without scales" in record.getMessage()
    assert "test: cache layer 2 (`l2`): the attention cannot be bounded" in record.getMessage()
    with pytest.raises(ValueError, match=r"^test: cache layer 2 \(`l2`\).* No cache layer can "
                                         r"be bounded \(1 refused\): there is nothing to "
                                         "export"):
        type(plan)((), refused).settle("test", partial=True)


def test_a_reader_of_a_refused_layer_is_refused_and_a_refused_reader_alone():
    """KV sharing: ``c`` reads layer 0, which is refused, so ``c`` has no scales either;
    ``d`` reads layer 1 but cannot be bounded itself: refused alone, layer 1 kept."""
    sites = [_site("a", 0, supported=False, reason="r"), _site("b", 1), _site("c", 2),
             _site("d", 3, supported=False, reason="s")]
    writes = [_write(0, "a", readers=("c",)), _write(1, "b", readers=("d",))]
    plan = plan_cache_layers(nn.Module(), sites, writes, "test")
    assert [(l.layer, l.site, l.readers) for l in plan.layers] == [(1, "b", ())]
    assert [(r.layer, r.site) for r in plan.refused] == [(0, "a"), ("c", "c"), ("d", "d")]
    assert "reads the keys and values of cache layer 0, which is refused" in \
        plan.refused[1].reason


def test_without_writes_the_sites_are_the_layers_one_to_one():
    """No write traced: layers at the modules' ``layer_idx`` (position otherwise), refused
    unless one to one onto 0..n-1."""
    model = nn.Module()
    model.x, model.y = nn.Module(), nn.Module()
    model.x.layer_idx, model.y.layer_idx = 1, 0
    layers = cache_layers(model, [_site("x", 0), _site("y", 1)], [], "test")
    assert [(l.layer, l.site, l.writes) for l in layers] == [(0, "y", ()), (1, "x", ())]
    untraced = _site("y", 1, value=None, value_reason="`conv1d` on the path")
    plan = plan_cache_layers(model, [_site("x", 0), untraced], [], "test")
    assert [l.layer for l in plan.layers] == [1]
    assert plan.refused == (LayerRefusal(0, "y", "the values could not be traced to their "
                                                 "projection (`conv1d` on the path), so v_scale "
                                                 "cannot be predicted"),)
    model.y.layer_idx = 1
    with pytest.raises(ValueError, match=r"\[\('x', 1\), \('y', 1\)\] do not map one to one"
                                         r".*\. Several attention modules write one cache"):
        plan_cache_layers(model, [_site("x", 0), _site("y", 1)], [], "test")


class _Picky(nn.Module):
    """A Hugging Face-like model (it has a ``generation_config``) that fails with its cache
    in use, as Bamba's does at a size with no attention layer."""
    generation_config = None

    def forward(self, x, use_cache=False, **kwargs):
        if use_cache:
            raise ValueError("`get_seq_length` can only be called on Attention layers")
        return 2 * x


def test_a_model_failing_with_its_cache_is_traced_without_it(caplog):
    model, calls = _Picky(), []

    def trace(kwargs):
        calls.append(kwargs)
        return model(torch.ones(1), **kwargs)

    with caplog.at_level(logging.INFO, logger="geoscale_fx"):
        out = traced_with_writes(trace, model, {"a": 1}, "test")
    assert calls == [{"a": 1, "use_cache": True}, {"a": 1, "use_cache": False}]
    assert float(out) == 2.0 and "_Picky fails with its cache in use (ValueError" in caplog.text
    plain, calls = nn.Identity(), []          # not a Hugging Face model: the call as given
    assert float(traced_with_writes(lambda kw: calls.append(kw) or plain(torch.ones(1)),
                                    plain, {"a": 1}, "test")) == 1.0
    assert calls == [{"a": 1}]
