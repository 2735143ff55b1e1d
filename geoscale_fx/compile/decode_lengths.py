"""The lengths a decode step grows, marked dynamic before Dynamo compiles the step.

Dynamo compiles a call with the shapes it sees, and makes a dim symbolic only once a later
call shows it changed (automatic dynamic shapes). A Hugging Face ``generate`` therefore
compiled three graphs of a model's call: the prefill, the first decode step with the cache
length static, and the second decode step again with the length symbolic, the first decode
graph never to run again. ``DecodeLengths.mark(kwargs)``, called before the compiled call,
marks the dims that grow by the step's tokens at the first call of each cache that already
holds tokens (``torch._dynamo.maybe_mark_dynamic``, a hint Dynamo drops where the graph needs
the size static):

* the keys and values of the cache's growing layers (transformers' ``DynamicLayer`` and its
  subclasses, geoscale's FP8/NVFP4 layers among them) along their length, dim -2; a static
  layer's preallocated storage, a linear-attention layer's state and an encoder-decoder
  model's cross-attention cache keep their sizes and are left alone;
* the 2-D mask over the cached and new tokens (``attention_mask``, or an encoder-decoder
  model's ``decoder_attention_mask``), its last dim.

The first decode step then compiles the symbolic graph directly: two compiles per
``generate`` instead of three, and the graph is the one Dynamo would have compiled at the
second step. A cache is marked once (at its first non-empty call; later steps hit that
graph unmarked), so a decode step costs two dict lookups. A call without a cache, or with
an empty one (the prefill), is left as Dynamo sees it.

Example::

    >>> lengths = DecodeLengths()
    >>> lengths.mark(dict(input_ids=ids, attention_mask=mask, past_key_values=cache))
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Iterator

import torch

from geoscale_fx.kv_cache.manager import passed_cache

__all__ = ["DecodeLengths"]


def _growing_layers(cache: Any) -> Iterator[Any]:
    """The layers of ``cache`` whose keys and values grow along dim -2 at each step."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    growing = getattr(cache_utils, "DynamicLayer", None)
    if growing is None:         # no transformers, or one whose caches keep no layer objects
        return
    own = getattr(cache, "self_attention_cache", cache)    # an encoder-decoder cache
    for layer in getattr(own, "layers", ()):
        if isinstance(layer, growing):
            yield layer


def _mask_name(cache: Any) -> str:
    return "decoder_attention_mask" if hasattr(cache, "self_attention_cache") \
        else "attention_mask"


class DecodeLengths:
    """Marks, once per non-empty cache, the dims a decode step grows (module docstring)."""

    def __init__(self):
        self._last = None           # a weak reference to the last cache marked
        self.marked = 0             # caches marked

    def mark(self, kwargs: dict) -> bool:
        """Mark ``kwargs``' growing dims if its cache holds tokens and was not marked yet."""
        _, cache = passed_cache(kwargs)
        if cache is None or not hasattr(cache, "get_seq_length"):
            return False
        if self._last is not None and self._last() is cache:
            return False
        if cache.get_seq_length() == 0:
            return False
        for layer in _growing_layers(cache):
            for states in (layer.keys, layer.values):
                if isinstance(states, torch.Tensor) and states.dim() >= 2:
                    torch._dynamo.maybe_mark_dynamic(states, states.dim() - 2)
        mask = kwargs.get(_mask_name(cache))
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            torch._dynamo.maybe_mark_dynamic(mask, 1)
        try:
            self._last = weakref.ref(cache)
        except TypeError:           # a cache class with __slots__: marked at every call
            self._last = None
        self.marked += 1
        return True
