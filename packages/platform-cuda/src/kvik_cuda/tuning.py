"""The launch configurations of the shared Triton attention kernel on NVIDIA GPUs.

``kvik.triton_kernels`` holds the kernels; which tiles, warps and pipeline stages suit an
architecture is this platform's choice, registered for the "sm" architectures when it is selected
(kvik_cuda.registration).
"""

from __future__ import annotations

import functools

import torch
import triton

from kvik.triton_kernels.gemv import GemvConfig
from kvik.triton_kernels.paged_attention import AttentionConfig, block_rows


@functools.cache
def attention_config(
    arch: str, head_size: int, group: int, max_query_len: int, dtype: torch.dtype
) -> AttentionConfig:
    """The configuration on ``arch`` ("sm90", "sm100", ...): 64 keys a step, or 32 where a row
    of the head is wider than 256 bytes (fp32 at 128, or head size 256), pipelined in 3 stages
    (2 when wide) so the tiles fit Hopper's and Blackwell's shared memory."""
    if not arch.startswith("sm"):
        raise ValueError(f"kvik_cuda configures NVIDIA architectures (sm*), not {arch!r}")
    wide = triton.next_power_of_2(head_size) * dtype.itemsize > 256
    block_m = block_rows(group, max_query_len)
    return AttentionConfig(block_m, 32 if wide else 64, 4, 2 if wide else 3)


#: The longest inner dimension the one-row GEMV takes: past it, a program's loop over K is long and
#: the programs few (N / block_n), and cuBLAS's split-K product wins (Llama-3.1-8B's down_proj,
#: K = 14336, on the H200: docs/benchmarks.md).
GEMV_MAX_K = 8192


def gemv_config(arch: str, out_features: int, in_features: int) -> GemvConfig | None:
    """The one-row GEMV's configuration for a layer on ``arch``, or None to leave it to cuBLAS.

    Measured on Hopper only (the H200, Llama-3.1-8B's projections in a batch-1 decode step), so
    other architectures keep cuBLAS until they are measured. Wide layers (gate_up) take wider
    programs with a shorter K step."""
    if arch != "sm90" or in_features > GEMV_MAX_K:
        return None
    if out_features >= 16384:
        return GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
    return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)
