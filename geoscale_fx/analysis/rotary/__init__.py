"""Rotary position embeddings on the query/key path: their pieces, recognised as units,
proven rotations, and their gain.
"""
