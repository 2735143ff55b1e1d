"""The sides of a site's logit terms: which operand is the query, the projection and input
each comes from, LoRA adapters folded, GQA head mapping, MLA terms, sinks, and the values'
side.
"""
