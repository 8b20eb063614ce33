"""Loading plugins from the ``kvik`` entry-point group and collecting what they register."""

from __future__ import annotations

import difflib
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import pluggy

from kvik.plugins.hookcalls import (
    KvikPluggyManager,
    call_one,
    call_order,
    culprit,
    describe_error,
    spec_names,
    unknown_hooks,
)
from kvik.plugins.registry import Registry

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
    hook: str | None = None  # the hook that raised, or the unknown hook the plugin implements

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


#: The hooks through which plugins register names, with the registry each one fills.
REGISTRATION_HOOKS = (
    "kvik_register_attention_backends",
    "kvik_register_quantization_methods",
    "kvik_register_models",
    "kvik_register_commands",
)


class KvikPluginManager:
    """The one pluggy manager of the "kvik" project and what its plugins registered.

    Every hook is called through pluggy, one plugin at a time (see ``kvik.plugins.hookcalls``), so
    what is registered and what goes wrong is put down to the plugin responsible.
    """

    def __init__(self) -> None:
        self.pm = KvikPluggyManager()
        self.plugins: list[PluginInfo] = []
        self.attention_backends = Registry("attention backend")
        self.quantization_methods = Registry("quantization method")
        self.models = Registry("model architecture")
        self.commands = Registry("command")
        self.command_help: dict[str, str] = {}
        self._load_errors: list[PluginError] = []
        self._platform_errors: list[PluginError] = []
        self._platforms: list[tuple[str, type]] | None = None

    @property
    def errors(self) -> list[PluginError]:
        """Every plugin that failed: to import, its API check, a hook, or ``kvik_platform``."""
        self.platforms()
        return [*self._load_errors, *self._platform_errors]

    def load_entry_points(self) -> None:
        """Register every allowed entry point, then call their registration hooks in pluggy's
        order (so ``tryfirst`` and ``trylast`` hold across plugins)."""
        allow = allowed_plugins()
        added = []
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                module = ep.load()
            except Exception as e:  # a broken plugin is reported, never fatal to the others
                self._load_errors.append(PluginError(ep.name, dist, describe_error(e)))
                continue
            if self._register(module, ep.name, dist, version):
                added.append(ep.name)
        self._call_registrations(added)

    def add_plugin(self, plugin: object, name: str, dist: str = "?", version: str = "?") -> bool:
        """Register one plugin object (a module or any object with hook implementations) and
        call its registration hooks; False (with the reason in ``errors``) if it was refused."""
        if not self._register(plugin, name, dist, version):
            return False
        self._call_registrations([name])
        return self.pm.get_plugin(name) is plugin

    def _register(self, plugin: object, name: str, dist: str, version: str) -> bool:
        problem = check_api_version(getattr(plugin, "KVIK_PLUGIN_API", None))
        if problem is None and self.pm.get_plugin(name) is not None:
            problem = f"a plugin named {name!r} is already loaded"
        if problem is None and self.pm.is_registered(plugin):
            problem = f"the same plugin is already loaded as {self.pm.get_name(plugin)!r}"
        if problem is not None:
            self._load_errors.append(PluginError(name, dist, problem))
            return False
        try:
            self.pm.register(plugin, name=name)
        except Exception as e:  # e.g. a hook whose arguments are not the spec's
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._load_errors.append(PluginError(name, dist, describe_error(e)))
            return False
        module_name = getattr(plugin, "__name__", type(plugin).__name__)
        self.plugins.append(PluginInfo(name, dist, version, module_name))
        self._platforms = None
        self._check_pending()
        return self.pm.get_plugin(name) is plugin

    def _check_pending(self) -> None:
        """Refuse every plugin that implements a hook kvik does not have (a misspelling, or a hook
        of a newer kvik), naming the hook."""
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as e:
                name = self.pm.get_name(e.plugin) or "?"
                hooks, dist = unknown_hooks(self.pm, e.plugin), self._dist(name)
                self._drop(name)
                known = spec_names(self.pm)
                for hook in hooks:
                    close = difflib.get_close_matches(hook, known, n=1)
                    hint = (
                        f"did you mean {close[0]!r}?"
                        if close
                        else f"kvik's hooks: {', '.join(known)}"
                    )
                    why = f"it implements {hook!r}, which is not a kvik hook ({hint})"
                    self._load_errors.append(PluginError(name, dist, why, hook))

    def _call_registrations(self, names: list[str]) -> None:
        pending = set(names)
        for hook in REGISTRATION_HOOKS:
            for name in call_order(self.pm, hook):
                if name in pending:
                    self._call_registration(hook, name)

    def _call_registration(self, hook: str, name: str) -> None:
        # A wrapper that raises is dropped and the call made again without it; when the plugin
        # itself raises, it is dropped and the loop ends.
        while self.pm.get_plugin(name) is not None:
            try:
                call_one(self.pm, hook, name, register=self._register_callable(hook, name))
                return
            except Exception as e:
                blamed = culprit(self.pm, hook, e, name)
                dist = self._dist(blamed)
                self._drop(blamed)
                error = f"{hook} raised {describe_error(e)}"
                self._load_errors.append(PluginError(blamed, dist, error, hook))

    def _register_callable(self, hook: str, plugin: str) -> Callable[..., None]:
        if hook != "kvik_register_commands":
            return self._registry(hook).register_from(plugin)
        register_target = self.commands.register_from(plugin)

        def register_command(command: str, module: str, help: str = "") -> None:
            register_target(command, module)
            self.command_help[command] = help

        return register_command

    def _registry(self, hook: str) -> Registry:
        return {
            "kvik_register_attention_backends": self.attention_backends,
            "kvik_register_quantization_methods": self.quantization_methods,
            "kvik_register_models": self.models,
            "kvik_register_commands": self.commands,
        }[hook]

    def _dist(self, name: str) -> str:
        return next((p.dist for p in self.plugins if p.name == name), "?")

    def _drop(self, name: str) -> None:
        """Unregister a failed plugin and forget everything it registered."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        for hook in REGISTRATION_HOOKS:
            self._registry(hook).drop(name)
        self.command_help = {c: h for c, h in self.command_help.items() if c in self.commands}
        self.plugins = [p for p in self.plugins if p.name != name]
        self._platforms = None

    def platforms(self) -> list[tuple[str, type]]:
        """(plugin name, Platform class) for every plugin that provides a platform, in pluggy's
        call order; a plugin whose ``kvik_platform`` raises or returns no Platform class is in
        ``errors`` instead."""
        if self._platforms is None:
            from kvik.platforms.base import Platform  # here: kvik.platforms imports this module

            hook = "kvik_platform"
            found: list[tuple[str, type]] = []
            errors: list[PluginError] = []
            broken_wrappers: set[str] = set()
            for name in call_order(self.pm, hook):
                while True:
                    try:
                        results = call_one(self.pm, hook, name, skip_wrappers=broken_wrappers)
                    except Exception as e:
                        blamed = culprit(self.pm, hook, e, name)
                        error = f"{hook} raised {describe_error(e)}"
                        errors.append(PluginError(blamed, self._dist(blamed), error, hook))
                        if blamed == name:
                            break
                        broken_wrappers.add(blamed)  # and call this plugin again without it
                        continue
                    for cls in results:
                        if isinstance(cls, type) and issubclass(cls, Platform):
                            found.append((name, cls))
                        else:
                            error = f"{hook} returned {cls!r}, which is not a kvik Platform class"
                            errors.append(PluginError(name, self._dist(name), error, hook))
                    break
            self._platforms, self._platform_errors = found, errors
        return self._platforms


@cache
def get_plugin_manager() -> KvikPluginManager:
    """The process-wide plugin manager, with every allowed entry point loaded."""
    manager = KvikPluginManager()
    manager.load_entry_points()
    return manager
