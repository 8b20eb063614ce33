"""kvik's plugin system: hook specs and the plugin manager."""

from kvik.plugins.hookspecs import hookimpl, hookspec
from kvik.plugins.manager import PLUGIN_API_VERSION, PluginError, PluginInfo, get_plugin_manager

__all__ = [
    "PLUGIN_API_VERSION",
    "PluginError",
    "PluginInfo",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
]
