"""Hugging Face configs: a family's default config shrunk to a model of a few hundred thousand
parameters, the ``Auto`` class that builds or loads a config, and token inputs for one call.

:func:`shrink_config` rewrites a config's size fields by what their *names* say, never by
family, so it covers a model type nobody listed:

* the layer count (``num_hidden_layers`` and any ``num_*layers`` / ``n_*layers`` /
  ``encoder_layers`` / ``decoder_layers``) becomes ``LAYERS``, or more so that one layer of
  each kind survives: a kind is what a layer holds in every per-layer list (``layer_types``,
  a string named ``*pattern``, a dict of overrides keyed by layer index, whether a
  ``*layers`` list of indices such as ``moe_layers`` names it), a cycled
  ``*_types`` / ``*pattern`` shorter than the model, or an ``X_period`` / ``X_offset`` pair
  (made to select a layer of those kept);
* query heads n_q and key/value heads n_kv keep the GQA ratio r = n_q / n_kv:
  n_kv' = max(1, ``HEADS`` // r), n_q' = r·n_kv'; the width is d' = n_q'·``HEAD_DIM``;
  every per-head width (``*head_dim``, ``*head_size``, ``d_head``, ``d_kv``, ``rotary*_dim``)
  is scaled by one factor ``HEAD_DIM``/d_h, so head_dim becomes ``HEAD_DIM`` and sums stay
  sums (MLA's qk_head_dim = qk_nope_head_dim + qk_rope_head_dim);
* any other width (``*_size``, ``*_dim``, ``*_rank``, ``d_*``) is capped at ``WIDTH`` (one
  equal to the old width becomes d'), any other count (``num_*``, ``n_*``, experts, heads of
  other kinds) at ``COUNT``, the vocabulary and the context at ``WIDTH``; one cap per kind
  keeps ``a ≤ b`` between fields of that kind (top-k ≤ experts);
* special token ids beyond the new vocabulary move to its top, distinct ids staying
  distinct; sub-configs (``text_config``, …) and nested dicts (``rope_parameters``) are
  shrunk the same way.

Aliases (``n_embd`` for ``hidden_size`` …) are read from the config's own ``attribute_map``.
Fields naming images, patches, kernels, windows, chunks or buckets are left as they are: they
are not widths. Constraints between fields of different kinds that only a family knows (a
Mamba mixer's n_heads·d_head = expand·d) are not kept: such a family, or one whose default
config transformers itself cannot build, raises a ``ValueError`` naming it, the reason and
whether its default config builds (:func:`tiny_config`, :func:`tiny_model`).

Example::

    >>> from geoscale_fx.hf_configs import tiny_config, tiny_model
    >>> cfg = tiny_config("llama")
    >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    (64, 2, 4, 16)
    >>> model = tiny_model("qwen2", device="meta")      # shapes only, no memory
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LAYERS", "HEADS", "HEAD_DIM", "WIDTH", "COUNT", "shrink_config", "tiny_config",
           "causal_lm_types", "auto_model_class", "model_from_config", "tiny_model",
           "token_inputs"]

LAYERS = 2        # layers of a shrunk model (more when it has more kinds of layer)
HEADS = 4         # query heads of a shrunk MHA model; GQA: n_kv' · r
HEAD_DIM = 16     # d_h' of every head
WIDTH = 128       # cap of any other width, of the vocabulary and of the context
COUNT = 4         # cap of any other count (experts, top-k, groups, other heads)

_NOT_WIDTH = re.compile(r"image|patch|kernel|window|chunk|bucket|pixel|sampling")
_LAYERS = re.compile(r"^(num|n)_(\w+_)?layers$|^(encoder|decoder)_layers$")
_Q_HEADS = re.compile(r"attention_heads$")
_KV_HEADS = re.compile(r"(kv|key_value)_heads$")
_PER_HEAD = re.compile(r"head_(dim|size)$|(^|_)d_(head|kv)$|(rotary|rope)\w*_dim$")
_VOCAB = re.compile(r"vocab_size$")
_CONTEXT = re.compile(r"position_embeddings$|positions$|^max_seq(uence)?_len(gth)?$|^n_ctx$")
_WIDTH = re.compile(r"(_size|_dim|_rank)$|^d_|^n_embd$|^n_inner$")
_COUNT = re.compile(r"^(num|n)_|experts|_heads$")
_TOKEN_ID = re.compile(r"token_(id|ids|index)$")
_PATTERN = re.compile(r"(_types|pattern)$")     # a per-layer kind, cycled if shorter


@dataclass(frozen=True)
class _Shape:
    """What the shrinking reads of a config (before) or sets (after)."""
    layers: int
    n_q: int
    n_kv: int
    d_h: int
    hidden: int


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _standard_names(config) -> dict[str, str]:
    """Stored field name -> its standard name (``n_embd`` -> ``hidden_size``)."""
    return {stored: standard for standard, stored in getattr(config, "attribute_map", {}).items()}


def _old_shape(fields: dict, standard: dict[str, str]) -> _Shape:
    """The shape in ``fields`` (read from the dict: a per-layer config may refuse getattr)."""
    named = {standard.get(k, k): v for k, v in fields.items()}

    def value(name: str) -> int:
        return named[name] if _is_int(named.get(name)) else 0

    n_q, hidden = value("num_attention_heads"), value("hidden_size")
    d_h = value("head_dim") or (hidden // n_q if n_q else 0)
    return _Shape(value("num_hidden_layers"), n_q, value("num_key_value_heads") or n_q, d_h,
                  hidden)


def _kept_layers(fields: dict, n_layers: int) -> list[int]:
    """Indices of the layers a shrunk model keeps: the first of each kind, then the next ones
    up to ``LAYERS``; a kind is a layer's entries in every per-layer list and per-layer dict
    (keyed by layer index), and whether each list of layer indices names it. A kind pattern
    shorter than the model (cycled) keeps enough layers to hold each of its kinds."""
    per_layer = [v for k, v in fields.items() if len(_sequence(k, v)) == n_layers
                 and _layer_indices(k, v, n_layers) is None]
    per_layer += [[str(d.get(i)) for i in range(n_layers)]
                  for d in map(_by_layer, fields.values()) if d is not None]
    per_layer += [[i in chosen for i in range(n_layers)] for chosen in
                  (_layer_indices(k, v, n_layers) for k, v in fields.items()) if chosen]
    kinds = [tuple(str(seq[i]) for seq in per_layer) for i in range(n_layers)]
    kept = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    cycled = [c for c in (_sequence(k, v) for k, v in fields.items() if _PATTERN.search(k))
              if 0 < len(c) < n_layers]
    least = max([LAYERS] + [max(c.index(kind) for kind in c) + 1 for c in cycled if c])
    for i in range(n_layers):
        if len(kept) >= min(least, n_layers):
            break
        kept = sorted(set(kept + [i]))
    return kept


def _layer_indices(key: str, value, n_layers: int) -> set[int] | None:
    """The layers a ``*layers`` list of layer indices names (``moe_layers=[0, 1, …]``,
    strictly increasing, inside the model), else None."""
    if not key.endswith("layers") or not isinstance(value, list) or not value \
            or not all(_is_int(i) and 0 <= i < n_layers for i in value) \
            or any(a >= b for a, b in zip(value, value[1:])):
        return None
    return set(value)


def _by_layer(value) -> dict[int, Any] | None:
    """``{layer index: overrides}`` of a dict of dicts keyed by layer indices
    (``{"05": {"head_dim": 512}}``), else None."""
    if not isinstance(value, dict) or not value or not all(
            isinstance(v, dict) and (isinstance(k, int) or isinstance(k, str) and k.isdigit())
            for k, v in value.items()):
        return None
    return {int(k): v for k, v in value.items()}


def _sequence(key: str, value) -> list | str:
    """``value`` if it may be per layer: a list, or a string named a pattern."""
    if isinstance(value, list) or isinstance(value, str) and _PATTERN.search(key):
        return value
    return []


def _new_token_ids(fields: dict, vocab: int) -> dict:
    """Special token ids ≥ ``vocab`` moved to ``vocab - 1, vocab - 2, …`` (equal stay equal)."""
    ids = sorted({i for k, v in fields.items() if _TOKEN_ID.search(k)
                  for i in (v if isinstance(v, list) else [v]) if _is_int(i) and i >= vocab})
    moved = {old: vocab - 1 - n for n, old in enumerate(ids)}
    out = {}
    for key, value in fields.items():
        if _TOKEN_ID.search(key) and isinstance(value, list):
            out[key] = [moved.get(i, i) for i in value]
        elif _TOKEN_ID.search(key) and _is_int(value):
            out[key] = moved.get(value, value)
    return out


def _shrunk_int(key: str, value: int, old: _Shape, new: _Shape) -> int:
    """The new value of one integer field named ``key`` (its standard name where the config
    aliases one)."""
    def named(pattern: re.Pattern) -> bool:
        return bool(pattern.search(key))

    if key == "num_hidden_layers" or named(_LAYERS):
        return min(value, new.layers)
    if named(_KV_HEADS):
        return new.n_kv if value == old.n_kv else min(value, COUNT)
    if named(_Q_HEADS):
        return new.n_q if value == old.n_q else min(value, COUNT)
    if key == "hidden_size":
        return new.hidden
    if named(_NOT_WIDTH):
        return value
    if named(_PER_HEAD) and old.d_h:   # one factor for all: nope + rope = qk stays true
        return max(2, 2 * round(value * HEAD_DIM / old.d_h / 2))
    if named(_VOCAB) or named(_CONTEXT):
        return min(value, WIDTH)
    if named(_WIDTH):
        return new.hidden if value == old.hidden else min(value, WIDTH)
    if named(_COUNT):
        return min(value, COUNT)
    return value


def _shrunk_value(key: str, value, old: _Shape, new: _Shape, kept: list[int]):
    """An int by :func:`_shrunk_int`; a dict entry by entry (``rope_parameters`` …), one keyed
    by layer index reduced to the ``kept`` layers, renumbered; anything else as it is."""
    if _is_int(value) and value > 0:
        return _shrunk_int(key, value, old, new)
    if not isinstance(value, dict):
        return value
    if _by_layer(value) is not None and old.layers > len(kept):
        width = len(str(next(iter(value))))
        keys = {int(k): k for k in value}
        return {(str(n).zfill(width) if isinstance(keys[i], str) else n):
                _shrunk_value(key, value[keys[i]], old, new, kept)
                for n, i in enumerate(kept) if i in keys}
    return {k: _shrunk_value(k if isinstance(k, str) else key, v, old, new, kept)
            for k, v in value.items()}


def _layer_periods(fields: dict, layers: int) -> dict:
    """``X_period``/``X_offset`` pairs (layer i is of kind X when i % period == offset) that
    still select a layer of the ``layers`` kept."""
    out = {}
    for key, period in fields.items():
        offset_key = key.removesuffix("_period") + "_offset"
        if key.endswith("_period") and _is_int(period) and _is_int(fields.get(offset_key)):
            out[key] = max(1, min(period, layers))
            out[offset_key] = fields[offset_key] % out[key]
    return out


def _shrunk_fields(config) -> dict[str, Any]:
    """``config.to_dict()`` with every size field shrunk (sub-configs recursively)."""
    import transformers

    fields = config.to_dict()
    standard = _standard_names(config)
    old = _old_shape(fields, standard)
    ratio = old.n_q // old.n_kv if old.n_kv and old.n_q % old.n_kv == 0 else 1
    n_kv = max(1, HEADS // ratio) if old.n_kv else 0
    kept = _kept_layers(fields, old.layers) if old.layers else []
    new = _Shape(len(kept), n_kv * ratio, n_kv, HEAD_DIM,
                 n_kv * ratio * HEAD_DIM if old.n_q else min(old.hidden, WIDTH))
    for key, value in fields.items():
        sub = getattr(config, key, None) if isinstance(value, dict) else None
        chosen = _layer_indices(key, value, old.layers)
        if isinstance(sub, transformers.PreTrainedConfig):
            fields[key] = _shrunk_fields(sub)
        elif chosen is not None:
            fields[key] = [n for n, i in enumerate(kept) if i in chosen]
        elif old.layers > len(kept) and len(_sequence(key, value)) == old.layers:
            picked = [value[i] for i in kept]
            fields[key] = "".join(picked) if isinstance(value, str) else picked
        else:
            fields[key] = _shrunk_value(standard.get(key, key), value, old, new, kept)
    fields.update(_layer_periods(fields, new.layers))
    vocab = fields.get(next((k for k, s in standard.items() if s == "vocab_size"), "vocab_size"))
    # ids of a composite config index its text model's vocabulary, at most WIDTH now
    fields.update(_new_token_ids(fields, vocab if _is_int(vocab) else WIDTH))
    return fields


def shrink_config(config):
    """A copy of ``config`` with every size field shrunk (see the module docstring)."""
    return type(config).from_dict(_shrunk_fields(config))


def tiny_config(model_type: str, **overrides):
    """The default config of transformers ``model_type``, shrunk (``overrides`` set after).

    Raises ``ValueError`` naming ``model_type`` when transformers does not know it or
    refuses its default config, or the shrunk one.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        known = sorted(causal_lm_types())
        raise ValueError(f"model type {model_type!r}: not a transformers model type (causal "
                         f"LMs of transformers {transformers.__version__}: "
                         f"{', '.join(known[:8])}, … {len(known)} in all)")
    try:
        config = transformers.AutoConfig.for_model(model_type)
    except Exception as exc:  # a family's own validation of its defaults
        raise ValueError(f"model type {model_type!r}: transformers refuses its default config "
                         f"({type(exc).__name__}: {exc})") from exc
    try:
        config = shrink_config(config)
    except Exception as exc:  # a family's own validation of the shrunk fields
        raise ValueError(f"model type {model_type!r}: its shrunk config is refused "
                         f"({type(exc).__name__}: {exc})") from exc
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def causal_lm_types() -> dict[str, str]:
    """transformers' causal-LM model types -> class names (``MODEL_FOR_CAUSAL_LM_MAPPING``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def auto_model_class(config):
    """``AutoModelForCausalLM`` for a causal LM (the saved architecture, else the model type,
    says which), else ``AutoModel``."""
    import transformers

    causal_lms = causal_lm_types()
    saved = (getattr(config, "architectures", None) or [None])[0]
    causal = (saved in causal_lms.values() if saved is not None
              else config.model_type in causal_lms)
    return transformers.AutoModelForCausalLM if causal else transformers.AutoModel


def model_from_config(config, *, device: str | torch.device = "cpu",
                      attn_implementation: str | None = None, seed: int = 0):
    """``auto_model_class(config).from_config(config)`` built on ``device`` (``"meta"``:
    shapes only), in eval mode; random weights from ``seed``, the global RNG untouched."""
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return auto_model_class(config).from_config(config, **kwargs).eval()


def tiny_model(model_type: str, *, device: str | torch.device = "cpu",
               attn_implementation: str | None = None, seed: int = 0):
    """A random-weight model of ``model_type`` from :func:`tiny_config`, built as a causal
    LM when transformers has one for it (``is_decoder`` set), else as ``AutoModel``.

    Raises ``ValueError`` naming ``model_type`` and the reason when it cannot be built, and
    whether transformers' own default config of it builds (on the meta device).
    """
    import transformers

    config = tiny_config(model_type)
    if auto_model_class(config) is transformers.AutoModelForCausalLM \
            and getattr(config, "is_decoder", None) is False:
        config.is_decoder = True      # encoder families (BERT …) as causal LMs
    try:
        return model_from_config(config, device=device,
                                 attn_implementation=attn_implementation, seed=seed)
    except Exception as exc:  # any failure of a family's constructor is reported by name
        default = transformers.AutoConfig.for_model(model_type)
        try:
            model_from_config(default, device="meta")
            verdict = "its default config builds: the shrinking broke it"
        except Exception:  # noqa: BLE001 — only whether it builds matters here
            verdict = "its default config does not build either"
        raise ValueError(f"model type {model_type!r}: its shrunk config does not build "
                         f"({type(exc).__name__}: {exc}); {verdict}") from exc


def token_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 32) -> dict:
    """Keyword arguments of one call: random token ids ``(batch, seq_len)`` below the model's
    vocabulary (its input embedding's rows, else ``config.vocab_size``), seeded, on the
    model's device (meta for a model without weights); ``use_cache=False`` where the forward
    takes it, so that no cache holds keys."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    vocab = getattr(embeddings, "num_embeddings", None) or model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)  # (B, T)
    inputs = {"input_ids": ids.to(next(model.parameters()).device)}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    return inputs
