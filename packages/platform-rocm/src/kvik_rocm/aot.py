"""The AMD targets kvik's Triton kernels are compiled for ahead of time (in CI, without a GPU),
through ``kvik.triton_kernels.aot.compile_kernel``."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget

TARGETS = {"gfx942": GPUTarget("hip", "gfx942", 64)}
#: Local data share (LDS) a program may use, in bytes.
SHARED_MEMORY_LIMIT = {"gfx942": 64 * 1024}
