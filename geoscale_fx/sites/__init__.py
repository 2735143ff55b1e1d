"""What the analysis knows about an attention, as plain data: the site (``model``), the parts
of its logits (``terms``: sources, sides, terms, score modifiers) and the per-site scaling
state that ``state_dict`` carries (``state``).

Consumed by every layer above. May import ``core``, ``testing``.
"""
