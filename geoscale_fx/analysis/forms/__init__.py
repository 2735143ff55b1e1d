"""Finding attention sites and filling them: the forms recognised, the analyzers of opaque,
measured and cached-key sites, and what a forward reads from or writes to its KV cache.
"""
