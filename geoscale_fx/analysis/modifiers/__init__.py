"""Score modifiers, one module per kind: the ops between the summed logits and the softmax
(masks, position biases, softcaps, sinks).

A kind's module holds its recognizer (the ops of the use-def walk from a softmax that it
recognises, and the operand the scores come through: ``draft.Route``), the
``sites.terms.Modifier`` subclass it becomes on the site (its bound transform and whether
the FP8 q/k/v kernel can take it) and, when it needs one, its draft. ``registry.MODIFIERS``
lists the kinds; ``analysis.forms.find_sites`` dispatches to them. May import ``core``
through ``planning``, and ``analysis.fx``, ``analysis.index`` and ``analysis.sides``
(``analysis.forms`` imports it). A new modifier is one module here and one entry in
``MODIFIERS`` (docs/extending.md).
"""
