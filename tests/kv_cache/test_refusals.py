"""``geoscale_fx.kv_cache.refusals``: each refusal form gets its remedy, an unknown form the
generic line.

The reasons are those the export gave over transformers' families
(``python -m bench.export_families``, transformers 5.24), copied as they were said: each must
get the remedy of its form and no other, so a pattern that drifts from the analysis' wording
(or matches too much) fails here.
"""
from __future__ import annotations

import re

import pytest

from geoscale_fx.kv_cache.refusals import GENERIC_REMEDY, REMEDIES, LayerRefusal, remedy, with_remedy

#: a family's refusal as said -> the first words of its remedy
SAID = {
    # mamba, xlstm, bamba …
    "export_kv_scales: no attention found in MambaForCausalLM (CKPT)":
        "State-space and recurrent models",
    # olmo_hybrid (the values after a linear-attention layer)
    "the stored values `value_states_1` cannot be bounded from the weights (no normalization "
    "before the projection `value_states`: reached `hidden_states_11` (add))":
        "The projection's input is neither normalized",
    # xmod (a graph break before the projection)
    "the attention cannot be bounded from the weights (no normalization before the "
    "projection `linear`: reached `l_hidden_states_` (placeholder): an input of this graph "
    "(the caller's tensor, or a value from before a graph break), which no normalization or "
    "weight bounds)": "The projection's input is neither normalized",
    # jetmoe
    "the attention cannot be bounded from the weights (the query `q_embed` is not a "
    "projection of a normalized input: it comes from graph inputs `l_position_embeddings_1_`, "
    "`l_stack0_0_`, `l_position_embeddings_0_` (the caller's tensors, or values from before "
    "a graph break, which no weight bounds))": "A term of the query or key is computed outside",
    # zaya
    "the stored values `value_states` cannot be bounded from the weights (the values "
    "`value_states` mixes tokens within a head vector)": "The keys or values are mixed over",
    # inkling_text (a short convolution over tokens)
    "the stored values `value_states` cannot be bounded from the weights (`conv1d_1` (<built-in "
    "method conv1d of type object at 0x7f5107ccea40>) on the path from the projection is not "
    "a reshape, slice, cast, scalar scale or rotary embedding)":
        "The keys or values are mixed over",
    # blt, hrm_text
    "export_kv_scales: attention layers [('model.L_module.layers.0.self_attn', 0), "
    "('model.H_module.layers.0.self_attn', 0)] do not map one to one onto cache layers "
    "0..n-1 (layers sharing a cache, or attention the cache does not hold)":
        "Several attention modules write one cache layer index",
    # gemma4_unified_assistant, rwkv
    "export_kv_scales: RwkvForCausalLM fails on token ids alone (input_ids (1, 8)) with its "
    "weights standing in as zeros, so its attention cannot be traced without loading it":
        "Export it from the loaded model instead",
    # deepseek_v4: no remedy known
    "the attention cannot be bounded from the weights (`compressed` (new_zeros) on the path "
    "from the projection is not a reshape, slice, cast, scalar scale or rotary embedding)":
        "The analysis cannot bound this form",
}


@pytest.mark.parametrize("reason", SAID)
def test_each_form_said_gets_its_remedy_and_only_it(reason):
    assert remedy(reason).startswith(SAID[reason])
    matched = [text for pattern, text in REMEDIES if re.search(pattern, reason)]
    assert len(matched) <= 1, matched


def test_an_unknown_form_gets_the_generic_line_and_two_forms_both_remedies():
    assert remedy("`x` adds to the query/key something other than a rotary embedding") == \
        GENERIC_REMEDY
    both = remedy("no normalization before the projection `k`; the values `v` mixes tokens")
    assert both.startswith("The projection's input") and "mixed over positions" in both


def test_messages_are_one_paragraph_naming_the_layer_the_site_the_form_and_the_remedy():
    refusal = LayerRefusal(3, "model.layers.3.self_attn", "the attention cannot be bounded "
                           "from the weights (no normalization before the projection `q`: "
                           "reached `add` (add))")
    message = refusal.message("export_kv_scales")
    assert message == ("export_kv_scales: cache layer 3 (`model.layers.3.self_attn`): the "
                       "attention cannot be bounded from the weights (no normalization before "
                       "the projection `q`: reached `add` (add)). " + refusal.remedy)
    assert "\n" not in message and "\n" not in "".join(text for _, text in REMEDIES)
    reader = LayerRefusal("model.layers.5.self_attn", "model.layers.5.self_attn", "r")
    assert reader.describe().startswith("an attention reading another layer's cache (`model.")
    assert with_remedy("kv_cache: no attention found in Mamba.") == (
        "kv_cache: no attention found in Mamba. " + remedy("no attention found"))
