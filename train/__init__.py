"""Reusable training pieces (data, losses, loop helpers, checkpointing, tracking, export).

Filled by the recipe issues; no Hydra in here: recipes pass flat arguments.
"""
