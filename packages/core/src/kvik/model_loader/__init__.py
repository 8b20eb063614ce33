"""Model folders to ModelConfigs, and models built on a device with their weights.

``load_model`` and ``load_model_config`` are imported on first use: the package's light modules
(``weight_slice``, which the quantization methods' loaders import while plugins register) must not
pull in the loader, the layers and the ops (``kvik env`` imports none of them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvik.model_loader.loader import load_model, load_model_config

__all__ = ["load_model", "load_model_config"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvik.model_loader import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
