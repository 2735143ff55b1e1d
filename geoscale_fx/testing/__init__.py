"""Models at test size: Hugging Face configs shrunk to a few hundred thousand parameters,
the ``Auto`` class that builds each family, and the paper's four architectures.

Used by ``geoscale inspect``, the streamed export (which builds a family's model class from a
config) and the repository's tests and benchmarks. May import ``core``.
"""
