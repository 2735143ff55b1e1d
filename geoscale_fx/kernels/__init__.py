"""The attention the rewritten graph calls: FP8-quantized logits (fused flex_attention or
explicit, the paper's method, emulated), and FP8 Q/K/V attention (FlashAttention-3's FP8
forward on CUDA, its emulation elsewhere).

May import ``core`` through ``numerics``.
"""
