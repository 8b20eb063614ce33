"""Entry point ``cuda`` of the ``kvik`` group: the NVIDIA platform and the Triton attention
backend it shares with kvik_rocm (``kvik.triton_kernels``)."""

from __future__ import annotations

import kvik
from kvik.triton_kernels import TRITON_ATTENTION_BACKEND

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_platform():
    from kvik_cuda.platform import CudaPlatform

    return CudaPlatform


@kvik.hookimpl
def kvik_register_attention_backends(register):
    register("TRITON_ATTN", TRITON_ATTENTION_BACKEND)  # shared with kvik_rocm
