"""Entry point ``rocm`` of the ``kvik`` group: the AMD platform and the Triton attention backend
it shares with kvik_cuda (``kvik.triton_kernels``)."""

from __future__ import annotations

import kvik
from kvik.triton_kernels import TRITON_ATTENTION_BACKEND

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_platform():
    from kvik_rocm.platform import RocmPlatform

    return RocmPlatform


@kvik.hookimpl
def kvik_register_attention_backends(register):
    register("TRITON_ATTN", TRITON_ATTENTION_BACKEND)  # shared with kvik_cuda
