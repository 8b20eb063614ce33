"""Entry point ``cpu`` of the ``kvik`` group: the CPU platform and its attention backend."""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_platform():
    from kvik_cpu.platform import CpuPlatform

    return CpuPlatform


@kvik.hookimpl
def kvik_register_attention_backends(register):
    register("CPU_PAGED", "kvik_cpu.paged_attention:CpuPagedBackend")
    register("TORCH_SDPA", "kvik_cpu.attention:TorchSdpaBackend")
