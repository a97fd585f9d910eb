"""Shared pieces of the fedmm Flower app: data, models, config and results."""
