"""The fused MoE's launch configurations on AMD Instinct GPUs (CDNA3: MI300X, MI325X).

A rule, not a measured table: kvik_rocm has not run on an MI300X yet, so the tiles follow what
the shared kernel needs there, and vLLM's published MI300X MoE tables as a guide (16 x 64 tiles
with 128-deep K steps at decode sizes, 128 x 128 x 64 with 8 warps and 2 stages for prefill):

- CDNA3 has 64 KB of LDS a workgroup, so the pipeline's stages must fit in it. Our gate/up
  GEMM loads two weight tiles a K step (gate and up), so its prefill tile is 128 x 64, not
  128 x 128; stages drop from 2 to 1 where a tile would not fit twice.
- Gate/up and down share their row block, so the pairs are aligned once a step.
- No swapped or paired tiles: those are for Hopper's wgmma (kvik.triton_kernels.fused_moe).
"""

from __future__ import annotations

import functools

import torch

from kvik.triton_kernels.fused_moe import MoeConfig

#: LDS a workgroup may use on CDNA3, less room for the epilogue's scratch.
LDS_BUDGET = 56 * 1024


def _stages(block_m: int, block_n: int, block_k: int, weight_tiles: int, itemsize: int) -> int:
    """Two pipeline stages where both fit in the LDS budget, else one."""
    tile_bytes = (block_m * block_k + weight_tiles * block_k * block_n) * itemsize
    return 2 if 2 * tile_bytes <= LDS_BUDGET else 1


@functools.cache
def fused_moe_config(
    arch: str, num_tokens: int, experts: int, inter: int, hidden: int, top_k: int, dtype
) -> tuple[MoeConfig, MoeConfig]:
    """The (gate/up, down) configurations on ``arch`` ("gfx942", ...) for a step of
    ``num_tokens`` tokens: row blocks by how many rows an expert gets on average."""
    if not arch.startswith("gfx"):
        raise ValueError(f"kvik_rocm configures AMD architectures (gfx*), not {arch!r}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"kvik_rocm's fused MoE runs bf16, fp16 and fp32 experts, not {dtype} (block-FP8 "
            "experts need CDNA3's e4m3fnuz format, which this platform does not convert to yet)"
        )
    itemsize = dtype.itemsize
    rows_per_expert = num_tokens * top_k / experts
    block_k = 32 if dtype == torch.float32 else 64
    if rows_per_expert <= 16:
        block_m, up_n, down_n, group_m, warps = 16, 64, 64, 1, 4
    elif rows_per_expert <= 64:
        block_m, up_n, down_n, group_m, warps = 32, 64, 64, 8, 4
    else:
        block_m, up_n, down_n, group_m, warps = 128, 64, 128, 8, 8
    up = MoeConfig(
        block_m, up_n, block_k, group_m, warps, _stages(block_m, up_n, block_k, 2, itemsize)
    )
    down = MoeConfig(
        block_m, down_n, block_k, group_m, warps, _stages(block_m, down_n, block_k, 1, itemsize)
    )
    return up, down
