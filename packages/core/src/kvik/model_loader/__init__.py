"""Model folders to ModelConfigs, and models built on a device with their weights."""

from kvik.model_loader.loader import load_model, load_model_config

__all__ = ["load_model", "load_model_config"]
