"""Planning: per site, whether and how it is rewritten (``plan``), and the scaling policies a
plan runs each step: the logits' FP8 scale (``scaling``) and the q/k/v descales
(``qkv_scaling``).

May import ``core`` through ``kernels``.
"""
