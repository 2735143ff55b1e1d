"""What users call on a model: ``apply_`` / ``restore_``, ``wrap``, ``compile_blocks``,
``calibrate``, ``report``, ``save_state`` / ``load_state``, DCP scaling state, and
``geoscale inspect``.

May import ``core`` through ``compile``.
"""
