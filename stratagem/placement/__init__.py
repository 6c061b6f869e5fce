"""Placements: where a strategy's variables live and what its scope does to modules and optimizers."""
