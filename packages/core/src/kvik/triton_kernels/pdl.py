"""Programmatic dependent launch (PDL) for the kernels of a decode step, on sm_90 and later.

A batch-1 decode step is ~350 short kernels in one CUDA graph (Llama-3.1-8B: 3 ms, 8.5 µs a
kernel on average), and between two of them the GPU sits idle while the last programs of one
drain and the next grid is launched and its programs are placed. Launched with PDL (the launch
attribute ``programmaticStreamSerialization``, Triton's ``launch_pdl`` option), a kernel may be
placed on the SMs before the kernel ahead of it in the stream has finished; its programs then
wait in ``griddepcontrol.wait`` until that kernel has completed and its memory is visible. So
the launch and placement overlap the previous kernel's tail instead of following it. A CUDA
graph captured from such launches keeps them as programmatic edges.

Every kernel that takes ``PDL`` calls ``wait_for_prior_kernel(PDL)`` before its first access to
global memory (loads and stores alike: the kernel ahead may still read what this one writes), so
the order of memory effects is the stream's order, as without PDL. Right after the wait it lets
its own dependents launch (``griddepcontrol.launch_dependents``), so that the chain continues.
The instructions are NVIDIA's: ``PDL`` is False under the interpreter, on AMD GPUs and on NVIDIA
GPUs before Hopper, and the branch is not compiled then. ``KVIK_PDL=0`` turns it off (read at
import).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as cuda_extra

ENABLED = os.environ.get("KVIK_PDL", "1") == "1"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_pdl(device: torch.device) -> bool:
    """A launch's ``PDL`` constexpr and ``launch_pdl`` option for tensors on ``device``."""
    if not ENABLED or _INTERPRET or device.type != "cuda" or torch.version.hip is not None:
        return False
    return cuda_capability(device.index)[0] >= 9


@functools.cache
def cuda_capability(index: int | None) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once (a launch asks on every call)."""
    return torch.cuda.get_device_capability(index)


@triton.jit
def wait_for_prior_kernel(PDL: tl.constexpr):
    """With PDL: wait until the kernel ahead in the stream has completed (its writes visible),
    then let the next kernel launch. Call it before any global memory access."""
    if PDL:
        cuda_extra.gdc_wait()
        cuda_extra.gdc_launch_dependents()
