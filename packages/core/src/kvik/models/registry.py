"""Model architectures (the ``architectures`` of a config.json) to model classes, via plugins."""

from __future__ import annotations

from torch import nn

from kvik.plugins import get_plugin_manager


def get_model_class(architecture: str) -> type[nn.Module]:
    models = get_plugin_manager().models
    if architecture not in models:
        supported = ", ".join(models.names()) or "none (is kvik-models installed?)"
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {supported}"
        )
    return models.resolve(architecture)
