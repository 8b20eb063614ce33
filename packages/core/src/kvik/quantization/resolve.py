"""Which quantization method a model uses: its checkpoint's ``quantization_config``, or the
``quantization`` engine option, resolved through the methods plugins registered
(``kvik_register_quantization_methods``), and whether a platform runs it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvik.platforms.base import Platform
    from kvik.plugins.manager import KvikPluginManager
    from kvik.quantization.base import QuantizationConfig

#: ModelOpt's older layout: the method in a file of its own beside config.json.
MODELOPT_FILE = "hf_quant_config.json"


def checkpoint_quantization(hf_config: Any, path: Path | None) -> dict[str, Any] | None:
    """The checkpoint's quantization configuration: config.json's ``quantization_config``, else
    ``hf_quant_config.json``'s, else None."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None:
        return config if isinstance(config, dict) else config.to_dict()
    if path is not None and path.is_dir() and (path / MODELOPT_FILE).is_file():
        with open(path / MODELOPT_FILE) as f:
            return json.load(f)
    return None


def checkpoint_method(config: dict[str, Any]) -> str:
    """The method name a checkpoint's quantization configuration declares."""
    method = config.get("quant_method")
    if method is None and isinstance(config.get("quantization"), dict):
        return "modelopt"  # hf_quant_config.json
    if not isinstance(method, str):
        raise ValueError(f"the checkpoint's quantization_config names no quant_method: {config}")
    return method.lower().replace("_", "-")


def _manager(manager: KvikPluginManager | None) -> KvikPluginManager:
    from kvik.plugins.manager import get_plugin_manager

    return manager or get_plugin_manager()


def method_class(name: str, manager: KvikPluginManager | None = None) -> type[QuantizationConfig]:
    return _manager(manager).quantization_methods.resolve(name)


def resolve_quantization(
    hf_config: Any,
    path: Path | None,
    requested: str | None,
    packed_modules_mapping: Mapping[str, tuple[str, int | str]],
    manager: KvikPluginManager | None = None,
) -> tuple[str | None, QuantizationConfig | None]:
    """(method name, its config for this model), or (None, None) for an unquantized model.

    ``requested`` is the ``quantization`` engine option: on a quantized checkpoint it must name
    the checkpoint's method; on an unquantized one it asks for online quantization."""
    checkpoint = checkpoint_quantization(hf_config, path)
    if checkpoint is not None:
        name = checkpoint_method(checkpoint)
        if requested is not None and requested != name:
            raise ValueError(
                f"the checkpoint is quantized with {name!r}, but quantization={requested!r} was "
                f"asked for; leave the option out or pass {name!r}"
            )
        config = method_class(name, manager).from_config(checkpoint)
    elif requested is not None:
        name = requested
        config = method_class(name, manager).from_flag()
    else:
        return None, None
    config.for_model(packed_modules_mapping)
    return name, config


def platform_supports(
    platform: type[Platform], name: str, manager: KvikPluginManager | None = None
) -> bool:
    """Whether ``platform`` runs the method ``name``: the platform lists it, or the method names
    the platform."""
    if name in platform.supported_quantization:
        return True
    try:
        return platform.name in method_class(name, manager).platforms
    except Exception:  # an unregistered or broken method is supported nowhere
        return False


def check_platform_supports(
    platform: type[Platform], name: str | None, manager: KvikPluginManager | None = None
) -> None:
    if name is None or platform_supports(platform, name, manager):
        return
    methods = supported_methods(platform, manager)
    raise ValueError(
        f"quantization method {name!r} is not supported on platform {platform.name!r} "
        f"(it runs: {', '.join(methods) or 'no quantization method'})"
    )


def supported_methods(
    platform: type[Platform], manager: KvikPluginManager | None = None
) -> list[str]:
    """The registered methods ``platform`` runs, by name."""
    registry = _manager(manager).quantization_methods
    return [n for n in registry.names() if platform_supports(platform, n, manager)]
