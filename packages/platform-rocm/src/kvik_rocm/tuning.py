"""The launch configurations of the shared Triton attention kernel on AMD Instinct GPUs.

``kvik.triton_kernels`` holds the kernels; the tiles for CDNA's 64 KB of LDS are this platform's
choice, registered for the "gfx" architectures when it is selected (kvik_rocm.registration).
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
    """The configuration on ``arch`` ("gfx942", ...): MI300X has 64 KB of LDS, so 32 keys a step
    (16 where a row of the head is wider than 256 bytes) and no software pipelining."""
    if not arch.startswith("gfx"):
        raise ValueError(f"kvik_rocm configures AMD architectures (gfx*), not {arch!r}")
    wide = triton.next_power_of_2(head_size) * dtype.itemsize > 256
    return AttentionConfig(block_rows(group, max_query_len), 16 if wide else 32, 4, 1)
