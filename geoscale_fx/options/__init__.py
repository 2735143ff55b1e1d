"""The options of the backend: ``GeoscaleOptions`` (one frozen, validated dataclass), the
recipes that spell them per strategy, and the rules between options.

May import ``core``, ``testing``, ``sites``.
"""
