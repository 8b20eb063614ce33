"""Entry point ``cuda`` of the ``kvik`` group: the NVIDIA platform.

The Triton attention backend ("TRITON_ATTN") is registered here once it exists.
"""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_platform():
    from kvik_cuda.platform import CudaPlatform

    return CudaPlatform
