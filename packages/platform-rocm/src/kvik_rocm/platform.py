"""The AMD platform: a ROCm build of torch with an Instinct GPU."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kvik.platforms.base import Platform

if TYPE_CHECKING:
    import torch

#: GCN architecture -> (product family, CDNA generation).
ARCHITECTURES = {
    "gfx908": ("MI100", "CDNA"),
    "gfx90a": ("MI200 series", "CDNA2"),
    "gfx942": ("MI300 series", "CDNA3"),
    "gfx950": ("MI350 series", "CDNA4"),
}

# The marketing name torch reports on ROCm, e.g. "AMD Instinct MI300X".
_PRODUCT = re.compile(r"\bMI\d{3}[A-Z]?\b")


def describe_gpu(name: str, gcn_arch_name: str) -> dict[str, Any]:
    """Name an AMD GPU from torch's device name and ``gcnArchName`` ("gfx942:sramecc+:xnack-")."""
    arch = gcn_arch_name.split(":")[0]
    family, generation = ARCHITECTURES.get(arch, ("unknown", "unknown"))
    # gfx942 is MI300X, MI300A and MI325X alike: the device name tells them apart.
    match = _PRODUCT.search(name)
    return {
        "name": name,
        "arch": arch,
        "product": match.group(0) if match else family,
        "generation": generation,
    }


class RocmPlatform(Platform):
    """AMD Instinct GPUs through a ROCm build of torch.

    torch's ROCm builds expose the GPU as device type "cuda" and use the CUDA dispatch key, so
    kvik's shared Triton kernels are registered in ``on_selected()``, never on import.
    """

    name = "rocm"
    device_type = "cuda"
    dist_backend = "nccl"  # RCCL, under torch's NCCL name
    priority = 100
    supported_dtypes = ("bfloat16", "float16", "float32")
    attention_backends = ("TRITON_ATTN",)
    # HIP graphs (torch.cuda.CUDAGraph on ROCm) are not wired in: kvik-rocm has not run on an
    # MI300X yet, so its steps run eagerly.
    graph_support = "none"

    @classmethod
    def is_present(cls) -> bool:
        import torch

        # On a ROCm build, device_count() asks amdsmi first and creates no context.
        return torch.version.hip is not None and torch.cuda.device_count() > 0

    @classmethod
    def details(cls) -> dict[str, Any]:
        import torch

        if not cls.is_present():
            return {"torch_hip": torch.version.hip}
        gpus = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpu = {"index": index} | describe_gpu(props.name, props.gcnArchName)
            gpus.append(gpu | {"total_memory_bytes": props.total_memory})
        return {"torch_hip": torch.version.hip, "gpus": gpus}

    @classmethod
    def device_capability(cls) -> tuple[int, int] | None:
        import torch

        return torch.cuda.get_device_capability(0)

    @classmethod
    def total_memory_bytes(cls) -> int:
        import torch

        return torch.cuda.get_device_properties(0).total_memory

    @classmethod
    def free_memory_bytes(cls) -> int:
        import torch

        return torch.cuda.mem_get_info(0)[0]

    @classmethod
    def device_memory_info(cls, device: torch.device) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info(device)

    @classmethod
    def on_selected(cls) -> None:
        from kvik_rocm.registration import register_kernels

        register_kernels()

    @classmethod
    def synchronize(cls) -> None:
        import torch

        torch.cuda.synchronize()
