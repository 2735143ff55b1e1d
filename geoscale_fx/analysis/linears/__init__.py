"""Low-precision linears (FP8 training linears): projections that cast their operands.

A Dynamo graph holds torchao's ``Float8Linear`` as one opaque call (an autograd function
Dynamo keeps whole); ``opaque_calls`` traces such a call to ATen operators, and each kind's
recognizer reads that arithmetic — the FP8 matmul and the casts of its operands — into a
``sites.linear_casts.LinearCast`` (``registry.LINEAR_KINDS``; ``aten_chains`` holds the
operand-cast recognizer, ``weight_program`` the slice that recomputes the dequantized
weight). ``analysis.sides.provenance`` asks the registry about any call it does not know.
May import ``core`` through ``planning``, and ``analysis.fx``.
"""
