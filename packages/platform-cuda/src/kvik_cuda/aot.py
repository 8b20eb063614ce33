"""The NVIDIA targets kvik's Triton kernels are compiled for ahead of time (in CI, without a GPU),
through ``kvik.triton_kernels.aot.compile_kernel``."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget

TARGETS = {
    "sm90": GPUTarget("cuda", 90, 32),
    "sm100": GPUTarget("cuda", 100, 32),
}
#: Shared memory a program may use, in bytes.
SHARED_MEMORY_LIMIT = {"sm90": 227 * 1024, "sm100": 227 * 1024}
