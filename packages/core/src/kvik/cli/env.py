"""``kvik env``: what this installation found.

Versions of kvik, Python and torch; every plugin with its entry-point name, distribution and
version; every platform with whether it is present and selected, the quantization methods it runs
and its details; what the plugins registered; and every plugin that failed to load. It selects a
platform but does not call its ``on_selected()``, so no kernel module (and no triton) is imported.
"""

from __future__ import annotations

import argparse
import json
import platform as python_platform
from typing import Any

import kvik
from kvik.platforms.selection import PlatformError, select_platform, survey
from kvik.plugins.manager import KvikPluginManager, get_plugin_manager
from kvik.plugins.registry import Registry
from kvik.quantization.resolve import supported_methods


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--device", help="the platform to select (default: KVIK_DEVICE, else automatic)"
    )


def _registered(registry: Registry) -> list[dict[str, str]]:
    def target(name: str) -> str:
        t = registry.targets[name]
        return t if isinstance(t, str) else f"{t.__module__}:{t.__qualname__}"

    return [
        {"name": name, "plugin": registry.owners[name], "target": target(name)}
        for name in registry.names()
    ]


def _details(cls: type) -> dict[str, Any]:
    try:
        return cls.details()
    except Exception as e:  # env reports, it never fails on one platform
        return {"error": f"{type(e).__name__}: {e}"}


def collect(device: str | None = None, manager: KvikPluginManager | None = None) -> dict[str, Any]:
    """The report ``kvik env`` prints, as plain data."""
    import torch

    manager = manager or get_plugin_manager()
    statuses = survey(manager)
    try:
        selected: str | None = select_platform(device, manager).name
        selection_error = None
    except PlatformError as e:
        selected, selection_error = None, str(e)
    platforms = []
    for s in statuses:
        entry: dict[str, Any] = {
            "name": s.cls.name,
            "plugin": s.plugin,
            "present": s.present,
            "selected": s.cls.name == selected,
            "priority": s.cls.priority,
            "device_type": s.cls.device_type,
            "dist_backend": s.cls.dist_backend,
            "attention_backends": list(s.cls.attention_backends),
            "quantization_methods": supported_methods(s.cls, manager),
            "details": _details(s.cls),
        }
        if s.error is not None:
            entry["error"] = s.error
        platforms.append(entry)
    return {
        "kvik_version": kvik.__version__,
        "python_version": python_platform.python_version(),
        "torch_version": torch.__version__,
        "plugins": [
            {"name": p.name, "dist": p.dist, "version": p.version, "module": p.module}
            for p in manager.plugins
        ],
        "platforms": platforms,
        "selected_platform": selected,
        "selection_error": selection_error,
        "attention_backends": _registered(manager.attention_backends),
        "quantization_methods": _registered(manager.quantization_methods),
        "models": _registered(manager.models),
        "errors": [
            {"name": e.name, "dist": e.dist, "hook": e.hook, "error": e.error}
            for e in manager.errors
        ],
    }


def _names(entries: list[dict[str, str]]) -> str:
    return ", ".join(f"{e['name']} ({e['plugin']})" for e in entries) or "none"


def format_text(report: dict[str, Any]) -> str:
    lines = [
        f"kvik {report['kvik_version']} (Python {report['python_version']}, "
        f"torch {report['torch_version']})",
        "",
        "plugins:",
    ]
    lines += [f"  {p['name']:<12} {p['dist']} {p['version']}" for p in report["plugins"]]
    lines += ["", "platforms:"]
    for p in report["platforms"]:
        mark = "*" if p["selected"] else " "
        state = "present" if p["present"] else "not present"
        lines.append(f"{mark} {p['name']:<12} {state}, priority {p['priority']}")
        if "error" in p:
            lines.append(f"    error: {p['error']}")
        lines.append(f"    quantization: {', '.join(p['quantization_methods']) or 'none'}")
        lines += [f"    {key}: {value}" for key, value in p["details"].items()]
    lines.append("")
    if report["selection_error"]:
        lines.append(f"selected: none: {report['selection_error']}")
    else:
        lines.append(f"selected: {report['selected_platform']}")
    lines += [
        f"attention backends: {_names(report['attention_backends'])}",
        f"quantization methods: {_names(report['quantization_methods'])}",
        f"models: {_names(report['models'])}",
    ]
    if report["errors"]:
        lines += ["", "errors:"]
        lines += [f"  {e['name']} ({e['dist']}): {e['error']}" for e in report["errors"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 1 when a plugin failed or no platform can be selected."""
    report = collect(args.device)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 1 if report["errors"] or report["selection_error"] else 0
