"""The example platform: ``kvik.platforms.Platform`` implemented from scratch, with the least a
vendor needs. It stands in for an accelerator on the host CPU, so that it runs anywhere."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvik.platforms.base import Platform

if TYPE_CHECKING:
    from kvik.config import EngineConfig


def _meminfo_bytes(field: str) -> int:
    """A field of /proc/meminfo ("MemTotal", "MemAvailable"), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024  # the file counts kB
    raise RuntimeError(f"/proc/meminfo has no {field} line")


class ExamplePlatform(Platform):
    # What kvik env lists and KVIK_DEVICE / --device name.
    name = "example"
    # The torch device type tensors live on; a vendor's own backend might be "privateuseone".
    device_type = "cpu"
    dist_backend = "gloo"
    # Automatic selection picks the present platform of highest priority: CPU 0, GPUs 100.
    priority = 50
    supported_dtypes = ("float32", "bfloat16")  # the first is what dtype="auto" means
    # Registered by this package's plugin module (kvik_register_attention_backends).
    attention_backends = ("EXAMPLE_SDPA",)

    @classmethod
    def is_present(cls) -> bool:
        # Cheap, imports no kernels and creates no device context. A real platform asks its
        # driver whether a device is visible; the example is present when asked for.
        return os.environ.get("KVIK_EXAMPLE_PLATFORM") == "1"

    @classmethod
    def details(cls) -> dict[str, Any]:
        return {"stands_in_on": "the host CPU", "total_memory_bytes": cls.total_memory_bytes()}

    @classmethod
    def total_memory_bytes(cls) -> int:
        return _meminfo_bytes("MemTotal")

    @classmethod
    def free_memory_bytes(cls) -> int:
        return _meminfo_bytes("MemAvailable")

    @classmethod
    def default_kv_cache_bytes(cls, config: EngineConfig) -> int:
        # The base class gives the KV cache 90% of the device's free memory, right for an
        # accelerator whose memory is the engine's alone. This stand-in shares the host's memory
        # with everything else, so it takes a quarter of what is available.
        return cls.free_memory_bytes() // 4

    @classmethod
    def on_selected(cls) -> None:
        # Called once when this platform is chosen, before any model is built: register your
        # kernels for kvik's small ops here, e.g.
        #     torch.library.register_kernel("kvik::rms_norm", "privateuseone", my_rms_norm)
        # Ops with no kernel registered for the device run kvik.ops' PyTorch references, which
        # is what this example does.
        pass
