"""Per-site numerics: canonical per-head weights of a site's terms, the certified logit bound
(RoPE over relative positions included), the bounds on the entries of q, k and v, the
per-step σ estimators, and what tensor parallelism communicates.

Pure functions of weights and site data. May import ``core`` through ``options``.
"""
