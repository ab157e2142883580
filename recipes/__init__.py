"""Training recipes, one readable file each: `python -m recipes.<name> [hydra overrides]`."""
