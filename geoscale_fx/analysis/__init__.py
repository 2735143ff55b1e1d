"""Analysis: capture a model as Dynamo does, find every attention of its FX graphs and trace
its query and key back to the weights, as ``AttentionSite`` data.

``capture`` and ``analyze`` (the driver with its registry of analyzers) sit here; the
recognizers are grouped by concern in subfolders: ``fx`` (graph vocabulary, names, DTensor,
activation checkpointing), ``index`` (index tracking and replay), ``rotary``, ``norms``
(inputs bounded by a normalization or by parameter values), ``sides`` (the sides and terms of
the logits), ``linears`` (low-precision projections: FP8 training linears),
``modifiers`` (one module per score modifier kind, and their registry) and
``forms`` (finding sites and the analyzers of each form). Reads graphs, never changes them.
May import ``core`` through ``planning``.
"""
