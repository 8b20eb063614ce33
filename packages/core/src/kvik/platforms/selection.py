"""Choosing the platform: an explicit device, or the present platform of highest priority."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvik.platforms.base import Platform
from kvik.plugins.manager import KvikPluginManager, get_plugin_manager


class PlatformError(RuntimeError, ValueError):
    """No platform can be chosen; the message says why and what was found. A ValueError too: it
    is the user's choice of device (or install) at fault, which the CLI and server report as
    such."""


@dataclass(frozen=True)
class PlatformStatus:
    plugin: str
    cls: type[Platform]
    present: bool
    error: str | None = None  # is_present() raised


def survey(manager: KvikPluginManager) -> list[PlatformStatus]:
    statuses = []
    for plugin, cls in manager.platforms():
        try:
            statuses.append(PlatformStatus(plugin, cls, bool(cls.is_present())))
        except Exception as e:
            statuses.append(PlatformStatus(plugin, cls, False, f"{type(e).__name__}: {e}"))
    return statuses


def _describe(statuses: list[PlatformStatus]) -> str:
    if not statuses:
        return (
            "no platform plugin is installed "
            "(pip install 'kvik[cpu]', 'kvik[cuda]' or 'kvik[rocm]')"
        )
    return ", ".join(
        f"{s.cls.name} ({'present' if s.present else 'not present'})" for s in statuses
    )


def select_platform(
    device: str | None = None, manager: KvikPluginManager | None = None
) -> type[Platform]:
    """The platform to run on: ``device`` or ``KVIK_DEVICE`` if given, else the best present one."""
    manager = manager or get_plugin_manager()
    statuses = survey(manager)
    device = device or os.environ.get("KVIK_DEVICE") or None
    if device is not None:
        for s in statuses:
            if s.cls.name == device:
                if not s.present:
                    why = f": {s.error}" if s.error else ""
                    raise PlatformError(
                        f"device {device!r} was asked for but is not present{why}; found: "
                        f"{_describe(statuses)}"
                    )
                return s.cls
        errors = "".join(f"; {e}" for e in manager.errors)
        raise PlatformError(f"no platform named {device!r}; found: {_describe(statuses)}{errors}")
    if manager.errors:
        # A platform that failed to load might have been the one meant: never pick another silently.
        raise PlatformError(
            "cannot choose a device automatically because a plugin failed to load: "
            + "; ".join(str(e) for e in manager.errors)
            + " (fix or uninstall it, or choose a device with --device / KVIK_DEVICE)"
        )
    present = [s for s in statuses if s.present]
    if not present:
        raise PlatformError(f"no platform is present; found: {_describe(statuses)}")
    best = max(s.cls.priority for s in present)
    top = [s for s in present if s.cls.priority == best]
    if len(top) > 1:
        names = " and ".join(f"{s.cls.name} (plugin {s.plugin})" for s in top)
        raise PlatformError(
            f"platforms {names} are both present with priority {best}; choose one with "
            "--device or KVIK_DEVICE"
        )
    return top[0].cls
