"""Scales for serving engines: KV-cache scales written as a checkpoint holds them, from a live
model or streamed from a saved checkpoint of any size (read by name, traced without weights),
and the live scales of an RL loop's current weights.

May import every folder below it (``core`` through ``api``).
"""
