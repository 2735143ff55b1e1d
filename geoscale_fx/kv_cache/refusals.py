"""Why a cache layer gets no certified k/v scale, and what would give it one.

A cache layer's scales are certified only when what it stores (and the queries of the
attention reading it) are bounded from the weights. When the analysis cannot bound them it
says why, in the words of the pass that stopped (``AttentionSite.reason``,
``CacheWrite.reason``): the *form* of the refusal. ``REMEDIES`` maps each form seen over
transformers' causal-LM families (``python -m bench.export_families``) to what would make the
layer bounded, in one place, so that every refusal — of the export
(``export_kv_scales``), of the FP8 KV cache of ``generate``, of a whole model or of one
layer — says the same thing about the same form. A form without a known remedy gets
``GENERIC_REMEDY``, an honest line naming the tool that shows the node.

``LayerRefusal`` is one refused cache layer (plain data): the export leaves it out of the
scales file and says so (serving engines load k/v scales per layer; vLLM's default for a
missing one is 1.0); the runtime raises its ``message``.

Example::

    >>> r = LayerRefusal(2, "model.layers.2.self_attn", "the stored values `v` cannot be "
    ...                  "bounded from the weights (no normalization before the projection "
    ...                  "`v_proj`: reached `add` (add))")
    >>> r.message("export_kv_scales").startswith(
    ...     "export_kv_scales: cache layer 2 (`model.layers.2.self_attn`): the stored values")
    True
    >>> "LayerNorm or RMSNorm" in r.remedy
    True
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

__all__ = ["GENERIC_REMEDY", "REMEDIES", "LayerRefusal", "remedy", "with_remedy"]

_FIND = "geoscale_fx.find_attention(model, **inputs)"
_EXPLAIN = "torch._dynamo.explain(model)(**inputs)"
_FORMS = "SDPA, softmax(QKᵀ)V written as matmuls, nn.MultiheadAttention"

#: ``(pattern, remedy)``: a refusal whose reason matches ``pattern`` (``re.search``) gets
#: ``remedy``; a reason naming several forms gets each of their remedies, in this order.
REMEDIES: tuple[tuple[str, str], ...] = (
    (r"reads the keys and values of cache layer \d+, which is refused",
     "It is bounded with the layer whose cache it reuses: see that layer's refusal."),
    (r"fails on token ids alone",
     "Export it from the loaded model instead: export_kv_scales(model, out_dir, "
     "input_ids=...) traces a real call, with whatever else its forward needs."),
    (r"no attention found in the model that wrote it|an attention writing some of them was "
     r"not found",
     f"The attention reading this cache layer was not recognized ({_FORMS}): {_FIND} lists "
     "the attentions the analysis finds in the traced forward."),
    (r"no attention found",
     "State-space and recurrent models (Mamba, RWKV, xLSTM) cache a state, not keys and "
     "values: there is nothing to scale. If the model does have attention, it is in none of "
     f"the recognized forms ({_FORMS}) or runs outside what Dynamo traces (a custom kernel, "
     f"a torch.compiler.disable region): {_FIND} returns what the analysis finds in the "
     "traced forward."),
    (r"do not map one to one onto cache layers|is written by the attentions",
     "Several attention modules write one cache layer index (sub-models with caches of their "
     "own, or one block called at several depths), while a checkpoint gives each attention "
     "module the scales of one cache layer: each gets scales once each attention writes a "
     "cache layer of its own (its own layer_idx, 0..n-1)."),
    (r"no normalization (found )?(within \d+ ops )?before the projection",
     "The projection's input is neither normalized in the traced graph nor bounded by the "
     "weights' values (walking back through the residual stream reached the op named "
     "above, which no weight bounds): bounded when a LayerNorm or RMSNorm precedes the "
     "projection in the same graph; a graph break between the two hides the norm "
     f"({_EXPLAIN} lists the breaks)."),
    (r"comes from graph inputs?",
     "A term of the query or key is computed outside the traced graph (position embeddings "
     "the caller passes in, or a value from before a graph break), so no weight bounds it: "
     "bounded when the forward computes it from its weights and constant tables (rotary "
     f"cos/sin built in the forward) within one graph; {_EXPLAIN} lists the graph breaks."),
    (r"mixes tokens|conv[123]d",
     "The keys or values are mixed over positions after the projection (a convolution over "
     "tokens before the cache write), which a bound per token of the projection does not "
     "cover: no weight-only bound exists for this form, so this layer can only be scaled "
     "from calibration data, which geoscale does not certify."),
)
GENERIC_REMEDY = (f"The analysis cannot bound this form from the weights; {_FIND} returns "
                  "the attention with the graph node it stopped at (site.reason).")


def remedy(reason: str) -> str:
    """What would make a layer refused for ``reason`` bounded: the remedies of every form in
    ``REMEDIES`` that ``reason`` names, else ``GENERIC_REMEDY``."""
    found = [text for pattern, text in REMEDIES if re.search(pattern, reason)]
    return " ".join(dict.fromkeys(found)) or GENERIC_REMEDY


def with_remedy(message: str) -> str:
    """``message`` (a refusal naming its subject and form) followed by its remedy, as one
    paragraph."""
    return f"{message.rstrip('.')}. {remedy(message)}"


@dataclass(frozen=True)
class LayerRefusal:
    """A cache layer whose scales cannot be bounded from the weights, decided from the trace
    alone (before any weight is read)."""
    #: the cache layer index; for an attention reading another layer's cache (KV sharing),
    #: which has none of its own, its name; None for an attention reading no cache layer
    layer: Union[int, str, None]
    site: str           # the attention whose scales these would be (or the writing module)
    reason: str         # the form, as the analysis says it

    @property
    def remedy(self) -> str:
        return remedy(self.reason)

    def describe(self) -> str:
        """One paragraph: the cache layer, the attention, the form, the remedy."""
        if isinstance(self.layer, int):
            where = f"cache layer {self.layer}"
        else:
            where = ("an attention reading another layer's cache" if self.layer
                     else "an attention reading no cache layer")
        return f"{where} (`{self.site}`): {self.reason.rstrip('.')}. {self.remedy}"

    def message(self, who: str) -> str:
        """``describe()`` prefixed with who refuses it."""
        return f"{who}: {self.describe()}"
