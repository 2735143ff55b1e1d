"""Shrinking a Hugging Face config to a model of a few hundred thousand parameters, by what
its fields' *names* say, never by family, so it covers a model type nobody listed.

:func:`shrink_config` rewrites a config's size fields:

* the layer count (``num_hidden_layers`` and any ``num_*layers`` / ``n_*layers`` /
  ``encoder_layers`` / ``decoder_layers``) becomes ``LAYERS``, or more so that one layer of
  each kind survives (two with ``per_kind=2``, for a layer that ties its weights to another
  of its kind: Zamba's hybrid layers; ``hf_configs.tiny_model`` retries with it): a kind
  is what a layer holds in every per-layer list (``layer_types``, a string named
  ``*pattern``, a dict of overrides keyed by layer index, whether a list of layer indices —
  ``*layers``, ``*_idxs``, ``*_indices``, ``*layer_ids``, such as ``moe_layers`` — names
  it); a count of some of the layers (``num_kv_shared_layers`` 15 of 35) keeps its share, at
  least one layer and never all; a cycled ``*_types`` / ``*pattern`` shorter than the model,
  or an ``X_period`` / ``X_offset`` pair (made to select a layer of those kept);
* query heads n_q and key/value heads n_kv keep the GQA ratio r = n_q / n_kv:
  n_kv' = max(1, ``HEADS`` // r), n_q' = r·n_kv'; the width is d' = n_q'·``HEAD_DIM``;
  every per-head width (``*head_dim``, ``*head_size``, ``d_head``, ``d_kv``, ``rotary*_dim``)
  is scaled by one factor ``HEAD_DIM``/d_h, so head_dim becomes ``HEAD_DIM`` and sums stay
  sums (MLA's qk_head_dim = qk_nope_head_dim + qk_rope_head_dim);
* any other width (``*_size``, ``*_dim``, ``*_rank``, ``d_*``) is capped at ``WIDTH`` (one
  equal to the old width becomes d'), any other count (``num_*``, ``n_*``, experts, heads of
  other kinds) at ``COUNT``, the vocabularies (``*vocab_size*``, ``*_vocab``) and the context
  at ``WIDTH``; one cap per kind keeps ``a ≤ b`` between fields of that kind (top-k ≤
  experts); experts that a count of groups (``n_group``, ``topk_group``) split in groups of
  two or more are raised to a multiple of it with two experts a group at least; a top-k of
  experts left None (``num_experts_per_tok``, ``top_k_experts``) becomes min(2, experts');
  a per-layer list of sizes is shrunk entry by entry;
* a mixer's H heads (``*heads``, a count) of D each (``*head_dim``, ``*headdim``,
  ``*d_head``: the same name but for the head words) keep its inner width (Mamba-2's
  n_heads·d_head = expand·d): H·D = E·d (E an ``*expand``) stays H'·D' = E·d', H·D = W (a
  width of that name, ``mamba_d_ssm``) H'·D' = W' ≤ ``WIDTH``; another width = E·d, E·d';
* special token ids beyond the new vocabulary move to its top, distinct ids staying
  distinct; sub-configs (``text_config``, …) and nested dicts (``rope_parameters``) are
  shrunk the same way; a field equal to a sub-config ``X_config``'s width and named by
  ``X`` (``hidden_size_global`` next to ``global_config``) takes its new width.

Aliases (``n_embd`` for ``hidden_size`` …) are read from the config's own ``attribute_map``.
Fields naming images, patches, kernels, windows, chunks or buckets are left as they are: they
are not widths. A constraint between fields that only a family's code knows is not kept:
the family's config class may refuse the result (``hf_configs.tiny_config`` names it).

Example::

    >>> import transformers
    >>> from geoscale_fx.testing.hf_config_shrinker import shrink_config
    >>> big = transformers.LlamaConfig(hidden_size=8192, num_attention_heads=64,
    ...                                num_key_value_heads=8, num_hidden_layers=80)
    >>> small = shrink_config(big)                     # GQA ratio 8 kept: 8 q heads over 1
    >>> small.num_attention_heads, small.num_key_value_heads, small.head_dim, small.hidden_size
    (8, 1, 16, 128)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["LAYERS", "HEADS", "HEAD_DIM", "WIDTH", "COUNT", "shrink_config"]

LAYERS = 2        # layers of a shrunk model (more when it has more kinds of layer)
HEADS = 4         # query heads of a shrunk MHA model; GQA: n_kv' · r
HEAD_DIM = 16     # d_h' of every head
WIDTH = 128       # cap of any other width, of the vocabulary and of the context
COUNT = 4         # cap of any other count (experts, top-k, groups, other heads)

_NOT_WIDTH = re.compile(r"image|patch|kernel|window|chunk|bucket|pixel|sampling")
_LAYERS = re.compile(r"^(num|n)_(\w+_)?layers(_per_\w+)?$|^(encoder|decoder)_layers$")
_LAYER_LIST = re.compile(r"(layers|_idxs|_indices|layer_ids)$")   # a list of layer indices
_Q_HEADS = re.compile(r"attention_heads$")
_KV_HEADS = re.compile(r"(kv|key_value)_heads$")
_PER_HEAD = re.compile(r"head_(dim|size)$|(^|_)d_(head|kv)$|(rotary|rope)\w*_dim$")
_VOCAB = re.compile(r"vocab_size|_vocab$")     # vocab_size_per_layer_input, *_hash_vocab
_CONTEXT = re.compile(r"position_embeddings$|positions$|^max_seq(uence)?_len(gth)?$|^n_ctx$")
_WIDTH = re.compile(r"(_size|_dim|_rank)$|^d_|^n_embd$|^n_inner$")
_COUNT = re.compile(r"^(num|n)_|experts|_heads$")
_GROUPS = re.compile(r"groups?$")                # a count of groups (of experts …)
_EXPERTS = re.compile(r"experts$")
_TOP_K = re.compile(r"experts_per_tok$|^top_?k_experts$")   # experts chosen per token
_MIXER_HEAD_DIM = re.compile(r"head_?dim$|(^|_)d_head$")    # a mixer's width per head
_WIDE = re.compile(r"(_size|_dim|_rank)$|(^|_)d_")          # named as a width
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


def _kept_layers(fields: dict, n_layers: int, per_kind: int = 1) -> list[int]:
    """Indices of the layers a shrunk model keeps: the first ``per_kind`` of each kind, then
    the next ones up to ``LAYERS``; a kind is a layer's entries in every per-layer list and
    per-layer dict (keyed by layer index), and whether each list of layer indices names it; a
    kind pattern shorter than the model (cycled) keeps enough layers to hold its kinds."""
    per_layer = [v for k, v in fields.items() if len(_sequence(k, v)) == n_layers
                 and _layer_indices(k, v, n_layers) is None]
    per_layer += [[str(d.get(i)) for i in range(n_layers)]
                  for d in map(_by_layer, fields.values()) if d is not None]
    per_layer += [[i in chosen for i in range(n_layers)] for chosen in
                  (_layer_indices(k, v, n_layers) for k, v in fields.items()) if chosen]
    kinds = [tuple(str(seq[i]) for seq in per_layer) for i in range(n_layers)]
    kept = sorted(i for kind in set(kinds)
                  for i in [i for i, other in enumerate(kinds) if other == kind][:per_kind])
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
    if not _LAYER_LIST.search(key) or not isinstance(value, list) or not value \
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


def _kind(key: str) -> str | None:
    """What an integer field named ``key`` (its standard name) counts or measures."""
    kinds = [("layers", _LAYERS), ("kv_heads", _KV_HEADS), ("q_heads", _Q_HEADS),
             ("fixed", _NOT_WIDTH), ("per_head", _PER_HEAD), ("vocab", _VOCAB),
             ("vocab", _CONTEXT), ("width", _WIDTH), ("count", _COUNT)]
    if key in ("num_hidden_layers", "hidden_size"):
        return {"num_hidden_layers": "layers", "hidden_size": "hidden"}[key]
    return next((kind for kind, pattern in kinds if pattern.search(key)), None)


def _shrunk_int(key: str, value: int, old: _Shape, new: _Shape) -> int:
    """The new value of one integer field named ``key`` (its standard name where the config
    aliases one)."""
    kind = _kind(key)
    if kind == "layers" and key != "num_hidden_layers" and 0 < value < old.layers:
        # some of the layers (kv-shared, MTP …): their share, at least one, never all
        return max(1, min(new.layers - 1, round(value * new.layers / old.layers)))
    if kind == "layers":
        return min(value, new.layers)
    if kind in ("kv_heads", "q_heads"):
        heads = new.n_kv if kind == "kv_heads" else new.n_q
        return heads if value == (old.n_kv if kind == "kv_heads" else old.n_q) \
            else min(value, COUNT)
    if kind == "hidden":
        return new.hidden
    if kind == "per_head" and old.d_h:   # one factor for all: nope + rope = qk stays true
        return max(2, 2 * round(value * HEAD_DIM / old.d_h / 2))
    if kind == "vocab":
        return min(value, WIDTH)
    if kind == "width":
        return new.hidden if value == old.hidden else min(value, WIDTH)
    if kind == "count":
        return min(value, COUNT)
    return value


def _kept_groups(old: dict, new: dict, standard: dict[str, str]) -> dict:
    """Counts of experts n that a count of groups g splits in parts of two or more
    (``n_group`` groups of ``n_routed_experts``; ``topk_group`` of them chosen) are raised so
    that they still are: n' a multiple of g', n'/g' ≥ 2 (a top-2 within each group stays in
    range). A top-k of experts left None (``num_experts_per_tok``): min(2, experts')."""
    def named(pattern: re.Pattern) -> list[str]:
        return [k for k, v in old.items() if _is_int(v) and v > 0 and _is_int(new.get(k))
                and new[k] > 0 and pattern.search(standard.get(k, k))]

    groups, out = named(_GROUPS), {}
    for whole in named(_EXPERTS):
        value = new[whole]
        for part in (g for g in groups if old[whole] % old[g] == 0
                     and old[whole] >= 2 * old[g]):
            value = max(value, 2 * new[part])
            value += -value % new[part]
        if value != new[whole]:
            out[whole] = value
    experts = [new[k] for k in named(_EXPERTS) if "shared" not in k]   # topk(k=None) fails
    return out | {k: min(2, max(experts)) for k, v in old.items()
                  if v is None and experts and _TOP_K.search(standard.get(k, k))}


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


def _kept_products(old: dict, new: dict, standard: dict[str, str]) -> dict:
    """H heads of D (``mamba_n_heads``, ``mamba_d_head``: one name but for the head words)
    whose H·D was E·d (E an ``*expand``) or a width W of that name (``mamba_d_ssm``):
    D' = E·d'/H' or W'/H' (W' ≤ ``WIDTH``), H' lowered until it divides; a width that was
    E·d becomes E·d'."""
    ints = [k for k, v in old.items() if _is_int(v) and v > 0 and _is_int(new.get(k))]
    name = {k: standard.get(k, k) for k in ints}
    kind = {k: _kind(name[k]) for k in ints}
    parts = {k: set(name[k].split("_")) for k in ints}
    mixer = {k: parts[k] - {"num", "n", "heads", "head", "dim", "headdim", "d"} for k in ints}
    d = next((k for k in ints if kind[k] == "hidden"), None)
    inner = {old[e] * old[d]: new[e] * new[d] for e in ints if d and name[e].endswith("expand")}
    out = {w: inner[old[w]] for w in ints if kind[w] == "width" and old[w] in inner}
    for heads in (k for k in ints if kind[k] == "count" and name[k].endswith("heads")):
        for dim in (k for k in ints if _MIXER_HEAD_DIM.search(name[k])
                    and mixer[k] == mixer[heads]):
            product = old[heads] * old[dim]
            widths = [w for w in ints if old[w] == product and w not in (heads, dim)
                      and mixer[heads] and mixer[heads] <= parts[w] and _WIDE.search(name[w])]
            if product in inner or widths:
                total = inner.get(product) or min(new[widths[0]], WIDTH)
                n = min(new[heads], total)
                while total % n:
                    n -= 1
                out.update({heads: n, dim: total // n}, **{w: total for w in widths})
    return out


def _linked_widths(config, old: dict, new: dict) -> None:
    """Fields (of ``config`` or a sub-config) equal to a sub-config ``X_config``'s width and
    named by ``X`` (``hidden_size_global``, ``global_config``) take its new width."""
    subs = [k for k, v in new.items() if k.endswith("_config") and isinstance(v, dict)
            and hasattr(getattr(config, k, None), "attribute_map")]
    for key in subs:
        width = getattr(config, key).attribute_map.get("hidden_size", "hidden_size")
        for before, after in [(old, new)] + [(old[k], new[k]) for k in subs if k != key]:
            after.update({f: new[key][width] for f, v in before.items() if _is_int(v) and
                          v == old[key].get(width) and key[:-7] in f.split("_")})  # X_config: X


def _shrunk_fields(config, per_kind: int = 1) -> dict[str, Any]:
    """``config.to_dict()`` with every size field shrunk (sub-configs recursively)."""
    import transformers

    fields = config.to_dict()
    before = dict(fields)
    standard = _standard_names(config)
    old = _old_shape(fields, standard)
    ratio = old.n_q // old.n_kv if old.n_kv and old.n_q % old.n_kv == 0 else 1
    n_kv = max(1, HEADS // ratio) if old.n_kv else 0
    kept = _kept_layers(fields, old.layers, per_kind) if old.layers else []
    new = _Shape(len(kept), n_kv * ratio, n_kv, HEAD_DIM,
                 n_kv * ratio * HEAD_DIM if old.n_q else min(old.hidden, WIDTH))
    for key, value in fields.items():
        sub = getattr(config, key, None) if isinstance(value, dict) else None
        chosen = _layer_indices(key, value, old.layers)
        if isinstance(sub, transformers.PreTrainedConfig):
            fields[key] = _shrunk_fields(sub, per_kind)
        elif chosen is not None:
            fields[key] = [n for n, i in enumerate(kept) if i in chosen]
        elif old.layers and len(_sequence(key, value)) == old.layers:
            picked = [value[i] for i in kept]
            fields[key] = "".join(picked) if isinstance(value, str) else \
                [_shrunk_value(standard.get(key, key), v, old, new, kept) for v in picked]
        else:
            fields[key] = _shrunk_value(standard.get(key, key), value, old, new, kept)
    fields.update(_kept_groups(before, fields, standard))
    fields.update(_kept_products(before, fields, standard))
    _linked_widths(config, before, fields)
    fields.update(_layer_periods(fields, new.layers))
    vocab = fields.get(next((k for k, s in standard.items() if s == "vocab_size"), "vocab_size"))
    # ids of a composite config index its text model's vocabulary, at most WIDTH now
    fields.update(_new_token_ids(fields, vocab if _is_int(vocab) else WIDTH))
    return fields


def shrink_config(config, per_kind: int = 1):
    """A copy of ``config`` shrunk (module docstring), ``per_kind`` layers of each kind kept."""
    return type(config).from_dict(_shrunk_fields(config, per_kind))
