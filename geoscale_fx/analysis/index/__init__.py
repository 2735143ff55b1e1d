"""Index tracking: where each element of a value on the query/key path comes from, replayed
op by op from a projection to an attention operand.
"""
