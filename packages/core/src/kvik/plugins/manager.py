"""Loading plugins from the ``kvik`` entry-point group and collecting what they register."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pluggy

from kvik.plugins import hookspecs

#: The plugin API this core implements, "MAJOR.MINOR". A plugin declares the version it was built
#: for as ``KVIK_PLUGIN_API`` in its plugin module; it loads when the majors are equal and its
#: minor is not newer than ours (it may use no hook we lack).
PLUGIN_API_VERSION = "1.0"

ENTRY_POINT_GROUP = "kvik"


@dataclass(frozen=True)
class PluginInfo:
    name: str  # entry-point name, the one KVIK_PLUGINS lists
    dist: str
    version: str
    module: str


@dataclass(frozen=True)
class PluginError:
    name: str
    dist: str
    error: str

    def __str__(self) -> str:
        return f"plugin {self.name!r} (from {self.dist}) failed to load: {self.error}"


def _parse_api(version: str) -> tuple[int, int]:
    major, minor = str(version).split(".")[:2]
    return int(major), int(minor)


def check_api_version(declared: object) -> str | None:
    """Return why a plugin declaring ``declared`` cannot load, or None when it can."""
    if declared is None:
        return (
            f"it declares no KVIK_PLUGIN_API (this kvik implements plugin API {PLUGIN_API_VERSION})"
        )
    try:
        major, minor = _parse_api(str(declared))
    except ValueError:
        return f"its KVIK_PLUGIN_API {declared!r} is not of the form MAJOR.MINOR"
    core_major, core_minor = _parse_api(PLUGIN_API_VERSION)
    if major != core_major or minor > core_minor:
        return (
            f"it was built for plugin API {declared} but this kvik implements plugin API "
            f"{PLUGIN_API_VERSION}"
        )
    return None


def allowed_plugins() -> set[str] | None:
    """The KVIK_PLUGINS allow-list (entry-point names), or None when every plugin may load."""
    raw = os.environ.get("KVIK_PLUGINS")
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


@dataclass
class Registry:
    """Name -> import path or factory, as plugins registered them; resolved on first use."""

    kind: str
    targets: dict[str, hookspecs.Target] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    _resolved: dict[str, Any] = field(default_factory=dict)

    def register_from(self, plugin: str):
        def register(name: str, target: hookspecs.Target) -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
            if name in self.targets and self.owners[name] != plugin:
                if self.targets[name] == target:
                    return  # several plugins share one implementation (TRITON_ATTN): the first owns it
                raise ValueError(
                    f"{self.kind} {name!r} is registered by both {self.owners[name]!r} "
                    f"and {plugin!r}"
                )
            self.targets[name] = target
            self.owners[name] = plugin

        return register

    def names(self) -> list[str]:
        return sorted(self.targets)

    def __contains__(self, name: str) -> bool:
        return name in self.targets

    def resolve(self, name: str) -> Any:
        if name not in self.targets:
            known = ", ".join(self.names()) or "none"
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {known}")
        if name not in self._resolved:
            target = self.targets[name]
            if isinstance(target, str):
                module_name, _, attr = target.partition(":")
                obj: Any = importlib.import_module(module_name)
                for part in attr.split(".") if attr else []:
                    obj = getattr(obj, part)
            else:
                obj = target()
            self._resolved[name] = obj
        return self._resolved[name]


class KvikPluginManager:
    """The one ``pluggy.PluginManager("kvik")`` and what its plugins registered."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("kvik")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.errors: list[PluginError] = []
        self.attention_backends = Registry("attention backend")
        self.quantization_methods = Registry("quantization method")
        self.models = Registry("model architecture")
        self.commands = Registry("command")
        self.command_help: dict[str, str] = {}
        self._platforms: list[tuple[str, type]] | None = None

    def load_entry_points(self) -> None:
        allow = allowed_plugins()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                module = ep.load()
            except Exception as e:  # a broken plugin is reported, never fatal to the others
                self.errors.append(PluginError(ep.name, dist, f"{type(e).__name__}: {e}"))
                continue
            self.add_plugin(module, ep.name, dist=dist, version=version)

    def add_plugin(self, plugin: object, name: str, dist: str = "?", version: str = "?") -> bool:
        """Register one plugin object (a module or any object with hook implementations)."""
        problem = check_api_version(getattr(plugin, "KVIK_PLUGIN_API", None))
        if problem is not None:
            self.errors.append(PluginError(name, dist, problem))
            return False
        try:
            self.pm.register(plugin, name=name)
            self._call_registrations(plugin, name)
        except Exception as e:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self.errors.append(PluginError(name, dist, f"{type(e).__name__}: {e}"))
            return False
        module_name = getattr(plugin, "__name__", type(plugin).__name__)
        self.plugins.append(PluginInfo(name, dist, version, module_name))
        self._platforms = None
        return True

    def _call_registrations(self, plugin: object, name: str) -> None:
        for hook, registry in (
            ("kvik_register_attention_backends", self.attention_backends),
            ("kvik_register_quantization_methods", self.quantization_methods),
            ("kvik_register_models", self.models),
        ):
            impl = getattr(plugin, hook, None)
            if impl is not None:
                impl(register=registry.register_from(name))
        impl = getattr(plugin, "kvik_register_commands", None)
        if impl is not None:
            register_target = self.commands.register_from(name)

            def register_command(command: str, module: str, help: str = "") -> None:
                register_target(command, module)
                self.command_help[command] = help

            impl(register=register_command)

    def platforms(self) -> list[tuple[str, type]]:
        """(plugin name, Platform class) for every plugin that provides a platform."""
        if self._platforms is None:
            found: list[tuple[str, type]] = []
            for info in self.plugins:
                plugin = self.pm.get_plugin(info.name)
                impl = getattr(plugin, "kvik_platform", None)
                if impl is None:
                    continue
                try:
                    cls = impl()
                except Exception as e:
                    self.errors.append(
                        PluginError(info.name, info.dist, f"{type(e).__name__}: {e}")
                    )
                    continue
                if cls is not None:
                    found.append((info.name, cls))
            self._platforms = found
        return self._platforms


@cache
def get_plugin_manager() -> KvikPluginManager:
    """The process-wide plugin manager, with every allowed entry point loaded."""
    manager = KvikPluginManager()
    manager.load_entry_points()
    return manager
