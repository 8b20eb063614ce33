"""Entry point ``cuda`` of the ``kvik`` group: the NVIDIA platform and its Triton attention."""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_platform():
    from kvik_cuda.platform import CudaPlatform

    return CudaPlatform


@kvik.hookimpl
def kvik_register_attention_backends(register):
    register("TRITON_ATTN", "kvik_cuda.attention:TritonAttentionBackend")
