"""What runs with a compiled graph on the host: one graph's runtime (cold start, weight
refresh, burn-in), the record of which tensors changed since the last call, and the trust in
cached keys' running maxima.

May import ``core`` through ``analysis``.
"""
