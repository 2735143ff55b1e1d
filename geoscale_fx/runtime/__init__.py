"""What runs with a compiled graph on the host: one graph's runtime (cold start, weight
refresh, burn-in), the record of which tensors changed since the last call (also asked by
``kv_cache``'s weight scales), and the trust in cached keys' running maxima with the protocol
the runtime calls it through.

May import ``core`` through ``analysis``.
"""
