"""Entry point ``server`` of the ``kvik`` group: adds ``kvik serve``."""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_register_commands(register):
    register("serve", "kvik_server.cli", "serve a model over an OpenAI-compatible HTTP API")
