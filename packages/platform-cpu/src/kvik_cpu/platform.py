"""The CPU platform: present everywhere; bf16 by default where the CPU computes it natively.

Its kernels take one of three paths (plain, avx512bf16, amx: kvik_cpu.isa), the best the CPU runs
unless ``KVIK_CPU_ISA`` forces another; the path decides the default dtype, how the weights are
packed and which attention code runs."""

from __future__ import annotations

import math
import mmap
import os
from typing import TYPE_CHECKING, Any

from kvik.platforms.base import Platform
from kvik_cpu import isa

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvik.config import EngineConfig
    from kvik.quantization.kernels import LinearKernel

# vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4): the KV cache gets 4 GiB unless told otherwise.
DEFAULT_KV_CACHE_BYTES = 4 * 1024**3


def has_native_bf16() -> bool:
    """AVX512-BF16 (and AMX with it): matrix products in bf16 run at full speed."""
    return isa.cpu_isa() >= isa.CpuIsa.AVX512BF16


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    supported_dtypes = ("float32", "bfloat16", "float16")
    attention_backends = ("CPU_PAGED", "TORCH_SDPA")
    # Every FP8 format runs on core's PyTorch kernels (kvik.quantization.fp8_reference).
    supported_quantization = ("fp8", "compressed-tensors", "modelopt")
    graph_support = "none"
    # Until on_selected() has built the C++ kernels of the small ops, the references are the CPU's
    # kernels, so the layers call them directly.
    ops_dispatch = "direct"

    @classmethod
    def is_present(cls) -> bool:
        return True

    @classmethod
    def details(cls) -> dict[str, Any]:
        try:
            selected = isa.selected_isa().label
        except ValueError as e:  # a bad KVIK_CPU_ISA: shown, not raised, by `kvik env`
            selected = f"error: {e}"
        return {
            "cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "total_memory_bytes": cls.total_memory_bytes(),
            "native_bf16": has_native_bf16(),
            "amx": isa.cpu_isa() >= isa.CpuIsa.AMX,
            "kernel_paths": [path.label for path in isa.runnable_isas()],
            "kernel_path": selected,
        }

    @classmethod
    def on_selected(cls) -> None:
        from kvik_cpu import extension

        # Loading the C++ ops registers their CPU kernels for torch.ops.kvik.* (csrc/small_ops.cpp);
        # models then call the ops rather than the references. If they did not build (load()
        # returns why), the references run directly (and TORCH_SDPA replaces CPU_PAGED).
        cls.ops_dispatch = "torch_ops" if extension.load() is None else "direct"
        # A forced path the CPU or the build cannot run fails here, before any model is built.
        isa.cap_onednn(isa.engine_isa())

    @classmethod
    def total_memory_bytes(cls) -> int:
        return _meminfo("MemTotal")

    @classmethod
    def free_memory_bytes(cls) -> int:
        return _meminfo("MemAvailable")

    @classmethod
    def default_dtype(cls) -> str:
        return "bfloat16" if isa.selected_isa() >= isa.CpuIsa.AVX512BF16 else "float32"

    @classmethod
    def default_kv_cache_bytes(cls, config: EngineConfig) -> int:
        return DEFAULT_KV_CACHE_BYTES

    @classmethod
    def zeroed_kv_cache(
        cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The cache in anonymous memory, which the OS maps to zero pages until a page is first
        written: no memset of the whole cache at start-up (``torch.zeros`` of the default 4 GiB
        took 2.0 s of every engine's start on a 2-core machine like CI's), and only the pages the cache has
        filled are resident. The tensor keeps the mapping alive and unmaps it when freed."""
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(memory, dtype=dtype).view(shape)

    @classmethod
    def prepare_model(cls, model: nn.Module, config: EngineConfig) -> None:
        """Mixture-of-experts layers get their experts packed for the CPU's kernels (the linear
        layers are packed by their quantization method: ``linear_kernel``)."""
        from kvik_cpu.linear import packed_linear_supported
        from kvik_cpu.moe import pack_expert_weights

        path = isa.engine_isa()
        # The plain path keeps the reference: what a CPU without native bf16 runs.
        if path >= isa.CpuIsa.AVX512BF16 and packed_linear_supported(config.model.dtype):
            pack_expert_weights(model, path)

    @classmethod
    def linear_kernel(cls, scheme: str, layer: nn.Module) -> LinearKernel:
        """Unquantized layers in bf16 on packed weights (kvik_cpu.linear); FP8 schemes and
        everything else on core's PyTorch kernels."""
        if scheme == "unquantized":
            from kvik_cpu.linear import packed_linear_kernel

            kernel = packed_linear_kernel(layer, isa.engine_isa())
            if kernel is not None:
                return kernel
        return super().linear_kernel(scheme, layer)

    @classmethod
    def fuses_activation_quantization(cls, kind: str) -> bool:
        """Yes for block FP8's per-token-group activations: core's PyTorch producers compute
        the same values as the products' own quantization (no faster, but the fused path then runs
        in CI on the CPU, where the FP8 products are core's references anyway)."""
        from kvik.quantization.activation import FP8_PER_TOKEN_GROUP

        return kind == FP8_PER_TOKEN_GROUP

    @classmethod
    def step_runner_class(cls, config: EngineConfig) -> type:
        from kvik_cpu.decode_layers import CpuStepRunner

        return CpuStepRunner
