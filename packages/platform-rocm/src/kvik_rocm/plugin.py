"""Entry point ``rocm`` of the ``kvik`` group: the AMD platform."""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_platform():
    from kvik_rocm.platform import RocmPlatform

    return RocmPlatform
