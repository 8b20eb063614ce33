"""The NVIDIA platform: GPUs found through NVML, so that no CUDA context is created."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvik.platforms.base import (
    Platform,
    max_num_batched_tokens_for_memory,
    max_num_seqs_for_memory,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvik.config import EngineConfig
    from kvik.quantization.kernels import LinearKernel

logger = logging.getLogger(__name__)
GiB = 1024**3

#: Compute capability -> architecture generation.
GENERATIONS = {
    (7, 0): "Volta",
    (7, 5): "Turing",
    (8, 0): "Ampere",
    (8, 6): "Ampere",
    (8, 7): "Ampere",
    (8, 9): "Ada",
    (9, 0): "Hopper",
    (10, 0): "Blackwell",
    (10, 3): "Blackwell",
    (12, 0): "Blackwell (consumer)",
}


class NvmlError(RuntimeError):
    """NVML is installed but answered with an error (no driver loaded, a GPU lost, ...)."""


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's index, which is CUDA's when CUDA_DEVICE_ORDER=PCI_BUS_ID
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int
    free_memory_bytes: int

    def describe(self) -> dict[str, Any]:
        major, minor = self.capability
        return {
            "index": self.index,
            "name": self.name,
            "capability": f"{major}.{minor}",
            "sm": f"sm{major}{minor}",
            "generation": GENERATIONS.get(self.capability, "unknown"),
            "total_memory_bytes": self.total_memory_bytes,
            "free_memory_bytes": self.free_memory_bytes,
        }


def visible_indices(count: int, uuids: Callable[[], list[str]]) -> list[int]:
    """The NVML indices CUDA_VISIBLE_DEVICES leaves visible, in its order.

    Entries are indices or GPU UUID prefixes; as in CUDA, the first invalid entry ends the list.
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(count))
    visible: list[int] = []
    for entry in (e.strip() for e in raw.split(",")):
        if entry.isdigit():
            index = int(entry)
        else:
            matches = [i for i, uuid in enumerate(uuids()) if entry and uuid.startswith(entry)]
            index = matches[0] if len(matches) == 1 else -1
        if not 0 <= index < count or index in visible:
            break
        visible.append(index)
    return visible


def nvml_gpus() -> list[Gpu] | None:
    """The visible GPUs as NVML reports them, or None when NVML is not installed here.

    Raises NvmlError when NVML is there but fails.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None
    except pynvml.NVMLError as e:
        raise NvmlError(f"NVML: {e}") from e
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = []
        for index in visible_indices(count, lambda: [pynvml.nvmlDeviceGetUUID(h) for h in handles]):
            handle = handles[index]
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                Gpu(
                    index=index,
                    name=pynvml.nvmlDeviceGetName(handle),
                    capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
                    total_memory_bytes=memory.total,
                    free_memory_bytes=memory.free,
                )
            )
        return gpus
    except pynvml.NVMLError as e:
        raise NvmlError(f"NVML: {e}") from e
    finally:
        pynvml.nvmlShutdown()


def _first_gpu() -> Gpu:
    gpus = nvml_gpus()
    if not gpus:
        raise RuntimeError("no NVIDIA GPU is visible through NVML")
    return gpus[0]


class CudaPlatform(Platform):
    """NVIDIA GPUs (Hopper and Blackwell first).

    Kernels are registered for the CUDA key in ``on_selected()``, never on import: ROCm builds of
    torch use the same key.
    """

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100
    supported_dtypes = ("bfloat16", "float16", "float32")
    attention_backends = ("TRITON_ATTN",)
    # Every FP8 format, on core's PyTorch kernels until faster ones are registered for its schemes
    # in linear_kernel.
    supported_quantization = ("fp8", "compressed-tensors", "modelopt")
    graph_support = "cuda_graphs"

    @classmethod
    def is_present(cls) -> bool:
        import torch

        if torch.version.hip is not None:
            return False  # a ROCm build of torch: its GPUs belong to kvik_rocm
        try:
            gpus = nvml_gpus()
        except NvmlError:
            return False
        if gpus is None:
            # No NVML library: torch's check, which tries NVML itself and then asks the CUDA
            # runtime for a device count (that initialises the driver but makes no context).
            return torch.cuda.device_count() > 0
        return len(gpus) > 0

    @classmethod
    def details(cls) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {"torch_cuda": torch.version.cuda}
        try:
            gpus = nvml_gpus()
        except NvmlError as e:
            return info | {"error": str(e)}
        if gpus is None:
            return info | {"nvml": "not available"}
        return info | {"gpus": [gpu.describe() for gpu in gpus]}

    @classmethod
    def device_capability(cls) -> tuple[int, int] | None:
        return _first_gpu().capability

    @classmethod
    def total_memory_bytes(cls) -> int:
        return _first_gpu().total_memory_bytes

    @classmethod
    def free_memory_bytes(cls) -> int:
        return _first_gpu().free_memory_bytes

    @classmethod
    def _total_memory_for_defaults(cls) -> int | None:
        """NVML's figure (torch's would make a CUDA context in the front end's process), or
        None where NVML fails or sees no GPU: the defaults then follow the base rules."""
        try:
            return cls.total_memory_bytes()
        except RuntimeError:  # NvmlError, or no GPU that NVML sees
            return None

    @classmethod
    def default_max_num_seqs(cls) -> int:
        total = cls._total_memory_for_defaults()
        if total is None:
            return super().default_max_num_seqs()
        return max_num_seqs_for_memory(total)

    @classmethod
    def default_max_num_batched_tokens(cls, serving: bool) -> int:
        total = cls._total_memory_for_defaults()
        if total is None:  # no memory figure: a server's steps are small on any GPU
            return max_num_batched_tokens_for_memory(0, serving)
        return max_num_batched_tokens_for_memory(total, serving)

    @classmethod
    def on_selected(cls) -> None:
        from kvik_cuda.registration import register_kernels

        register_kernels()

    @classmethod
    def linear_kernel(cls, scheme: str, layer: nn.Module) -> LinearKernel:
        """Unquantized batch-1 decode products on the one-row GEMV where it beats cuBLAS
        (kvik_cuda.linear), the LM head on cuBLAS writing fp32 logits, other unquantized
        products on cuBLAS (core's kernel); the FP8 schemes on kvik's Triton kernels and cuBLAS's
        scaled products as kvik_cuda.fp8 chooses them."""
        if scheme in ("fp8_block", "fp8_scaled"):
            # Core's kernels: torch.ops.kvik.fp8_*_linear, whose CUDA implementations are
            # kvik_cuda.fp8's (registered when the platform is selected: kvik_cuda.registration).
            return super().linear_kernel(scheme, layer)
        if scheme == "unquantized":
            from kvik.triton_kernels.attention import device_arch
            from kvik_cuda.linear import fp32_logits_kernel, one_row_gemv_kernel

            logits_kernel = fp32_logits_kernel(layer)
            if logits_kernel is not None:
                return logits_kernel
            arch, _ = device_arch(layer.weight.device)
            kernel = one_row_gemv_kernel(layer, arch)
            if kernel is not None:
                return kernel
        return super().linear_kernel(scheme, layer)

    @classmethod
    def fuses_activation_quantization(cls, kind: str) -> bool:
        """Block FP8's per-token-group input, written by the Triton RMSNorm and SiLU-and-mul,
        unless ``KVIK_FUSED_ACTIVATION_QUANT=0`` (kvik_cuda.tuning)."""
        from kvik.quantization.activation import FP8_PER_TOKEN_GROUP
        from kvik_cuda.tuning import FUSED_ACTIVATION_QUANT

        return FUSED_ACTIVATION_QUANT and kind == FP8_PER_TOKEN_GROUP

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        import torch

        if torch.version.cuda is None:
            raise ValueError(
                f"the cuda platform needs a CUDA build of torch; torch {torch.__version__} has no "
                "CUDA (install one, or choose another device with --device / KVIK_DEVICE)"
            )

    # The worker sizes the KV cache from a profiling step (kvik.worker.memory_profiling).
    profiles_memory = True

    @classmethod
    def device_memory_info(cls, device: torch.device) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info(device)

    @classmethod
    def reset_peak_memory(cls, device: torch.device) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(device)

    @classmethod
    def peak_memory_bytes(cls, device: torch.device) -> int:
        import torch

        return torch.cuda.max_memory_allocated(device)

    @classmethod
    def reserved_memory_bytes(cls, device: torch.device) -> int:
        import torch

        return torch.cuda.memory_reserved(device)

    @classmethod
    def empty_cache(cls, device: torch.device) -> None:
        import torch

        torch.cuda.empty_cache()

    @classmethod
    def step_runner_class(cls, config: EngineConfig) -> type:
        """FULL CUDA graphs for decode steps unless the config turns them off."""
        if config.compilation.use_cudagraphs:
            from kvik_cuda.graphs import CudaGraphStepRunner

            return CudaGraphStepRunner
        return super().step_runner_class(config)

    @classmethod
    def step_graphs(cls):
        from kvik_cuda.step_graphs import LazyStepGraphs

        return LazyStepGraphs()

    @classmethod
    def synchronize(cls) -> None:
        import torch

        torch.cuda.synchronize()
