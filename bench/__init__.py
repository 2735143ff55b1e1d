"""Benchmarks of geoscale-fx, run from a checkout: ``python -m bench`` and ``python -m bench.<name>``."""
