"""Reasoning parsers (``--reasoning-parser``): the model's thinking apart from its answer."""
