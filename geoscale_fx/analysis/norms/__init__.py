"""Inputs whose norm is bounded: by a normalization (RMSNorm, LayerNorm, L2 clips), or by
parameter values (embedding gathers, sums, masks) when no normalization precedes.
"""
