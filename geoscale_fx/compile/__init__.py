"""The torch.compile backend: the rewrite of each planned site, the ATen trace of rewritten
graphs and its on-disk cache, the backend itself, what it records per site, the registry of
live backends, and the attachment of state, backend and checked call to a model.

May import ``core`` through ``kv_cache``.
"""
