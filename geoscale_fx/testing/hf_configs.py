"""Hugging Face families at test size: a family's default config shrunk
(:func:`tiny_config`), the ``Auto`` class that builds or loads a config, a random-weight
model of a family (:func:`tiny_model`) and token inputs for one call.

The shrinking itself is generic (``geoscale_fx.testing.hf_config_shrinker``: by field names, never
by family); here a family's default config is made and its shrunk model built. A family
whose default config transformers cannot build, whose shrunk config its config class
refuses, or whose shrunk model does not build raises a ``ValueError`` naming it, the reason
and whether its default config builds.

Example::

    >>> from geoscale_fx.testing.hf_configs import tiny_config, tiny_model
    >>> cfg = tiny_config("llama")
    >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    (64, 2, 4, 16)
    >>> model = tiny_model("qwen2", device="meta")      # shapes only, no memory
"""
from __future__ import annotations

import inspect

import torch

from geoscale_fx.testing.hf_config_shrinker import shrink_config

__all__ = ["tiny_config", "causal_lm_types", "auto_model_class", "causal_lm_class",
           "model_from_config", "tiny_model", "token_inputs"]


def tiny_config(model_type: str, *, per_kind: int = 1, **overrides):
    """The default config of transformers ``model_type``, shrunk by
    :func:`~geoscale_fx.testing.hf_config_shrinker.shrink_config` keeping ``per_kind`` layers of each
    kind of layer (``overrides`` set after).

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
        config = shrink_config(config, per_kind=per_kind)
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


def causal_lm_class(config):
    """The class a saved causal LM with ``config`` is built with: ``AutoModelForCausalLM``
    when it maps the config's class, else the transformers class ``config.architectures``
    names (what serving engines read; Emu3's and Mllama's text models are saved with a text
    config that the auto class does not map). ``ValueError`` naming the model type if
    neither gives one."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM
    named = [getattr(transformers, name, None) for name in (
        getattr(config, "architectures", None) or [])]
    for cls in named:
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    raise ValueError(f"model type {config.model_type!r} ({type(config).__name__}): "
                     "AutoModelForCausalLM has no class for it and config.json's "
                     f"architectures {getattr(config, 'architectures', None)} name no "
                     f"transformers {transformers.__version__} model")


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
    LM when transformers has one for it (``is_decoder`` set), else as ``AutoModel``; a
    model with language adapters (``set_default_language``) uses its first language. One that
    does not build from one layer of each kind is built from two of each (a layer tying its
    weights to another of its kind: Zamba's hybrid layers share one block).

    Raises ``ValueError`` naming ``model_type`` and the reason when it cannot be built, and
    whether transformers' own default config of it builds (on the meta device).
    """
    import transformers

    def config_of(per_kind: int):
        config = tiny_config(model_type, per_kind=per_kind)
        if auto_model_class(config) is transformers.AutoModelForCausalLM \
                and getattr(config, "is_decoder", None) is False:
            config.is_decoder = True      # encoder families (BERT …) as causal LMs
        return config

    kwargs = {"device": device, "attn_implementation": attn_implementation, "seed": seed}
    config = config_of(per_kind=1)
    try:
        return _with_language(model_from_config(config, **kwargs), config)
    except Exception as exc:  # any failure of a family's constructor is reported by name
        failure = exc
    try:  # two layers of each kind: one tied to another of its kind has one to tie to
        config = config_of(per_kind=2)
        return _with_language(model_from_config(config, **kwargs), config)
    except Exception:  # noqa: BLE001 — the first failure is the one reported
        exc = failure
    default = transformers.AutoConfig.for_model(model_type)
    try:
        model_from_config(default, device="meta")
        verdict = "its default config builds: the shrinking broke it"
    except Exception:  # noqa: BLE001 — only whether it builds matters here
        verdict = "its default config does not build either"
    raise ValueError(f"model type {model_type!r}: its shrunk config does not build "
                     f"({type(exc).__name__}: {exc}); {verdict}") from exc


def _with_language(model, config):
    """``model``, with its first language set where it has language adapters (X-MOD)."""
    languages = list(getattr(config, "languages", None) or [])
    if hasattr(model, "set_default_language") and languages:
        model.set_default_language(languages[0])    # X-MOD: one adapter per language
    return model


def token_inputs(model: torch.nn.Module, batch: int = 1, seq_len: int = 32) -> dict:
    """Keyword arguments of one call: random token ids ``(batch, seq_len)`` below the model's
    vocabulary (its input embedding's rows, else ``config.vocab_size``), seeded, on the
    model's device (meta for a model without weights); ``use_cache=False`` where the forward
    takes it, or passes its ``**kwargs`` to a base model that does, so that no cache holds keys
    (nor is asked its length where no layer is attention: GraniteMoeHybrid's default)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    vocab = getattr(embeddings, "num_embeddings", None) or model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)  # (B, T)
    inputs = {"input_ids": ids.to(next(model.parameters()).device)}
    params = inspect.signature(model.forward).parameters
    base = getattr(model, "base_model", model)
    if "use_cache" in params or base is not model and "use_cache" in inspect.signature(
            base.forward).parameters and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        inputs["use_cache"] = False
    return inputs
