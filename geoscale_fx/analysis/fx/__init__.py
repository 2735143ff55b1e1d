"""Reading torch-level FX graphs: the vocabulary of operations, names in the user's model,
DTensor on the query/key path, and activation checkpointing opened up.
"""
