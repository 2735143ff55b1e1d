"""models_zoo: the models geoscale-fx is tested and benchmarked on, by name.

A repository tool (run from a checkout), not part of the installed ``geoscale_fx`` package.

    >>> import models_zoo
    >>> models_zoo.names()[:3]
    ['gpt2-xl', 'hf-gpt2', 'hf-llama']
    >>> zoo = models_zoo.get("mistral-7b")              # small, GQA 4:1, random weights
    >>> logits = zoo.model(**zoo.example_inputs()).logits

Modules: ``registry`` (``get``, ``names``, ``ZooModel``), ``configs`` (HF shapes, full and
small), ``nanogpt`` (our reference GPT), ``corpus`` (stdlib bytes as text), ``pretrain``
(``python -m models_zoo.pretrain``: small byte-level GPT-2 / Llama, cached), ``inspection``
(``python -m models_zoo.inspection NAME``: ``geoscale inspect`` for a zoo model).
"""
from models_zoo.registry import ZooModel, get, names

__all__ = ["ZooModel", "get", "names"]
