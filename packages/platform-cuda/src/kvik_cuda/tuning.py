"""The launch configurations of the shared Triton attention kernel on NVIDIA GPUs.

``kvik.triton_kernels`` holds the kernels; which tiles, warps and pipeline stages suit an
architecture is this platform's choice, registered for the "sm" architectures when it is selected
(kvik_cuda.registration).
"""

from __future__ import annotations

import functools

import torch
import triton

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
