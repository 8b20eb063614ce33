"""kvik_rocm's fused MoE launch rule (the kernels themselves compile for gfx942 in core's
test_triton_kernels_compile.py, which finds this chooser)."""

from __future__ import annotations

import pytest
import torch

from kvik.triton_kernels.fused_moe import moe_configs, register_moe_configs
from kvik_rocm.moe_tuning import LDS_BUDGET, fused_moe_config

# Qwen3-30B-A3B's experts (128 of 768 over 2048, top 8) and Mixtral's (8 of 14336 over 4096, top 2).
SHAPES = [(128, 768, 2048, 8), (8, 14336, 4096, 2)]


@pytest.mark.parametrize(("experts", "inter", "hidden", "top_k"), SHAPES)
@pytest.mark.parametrize("tokens", [1, 16, 256, 1024, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tiles_fit_cdna3_and_share_the_row_block(experts, inter, hidden, top_k, tokens, dtype):
    up, down = fused_moe_config("gfx942", tokens, experts, inter, hidden, top_k, dtype)
    # One alignment a step: the down GEMM reads the gate/up GEMM's row blocks.
    assert up.block_m == down.block_m
    for config, weight_tiles in ((up, 2), (down, 1)):
        tile = config.block_m * config.block_k + weight_tiles * config.block_k * config.block_n
        assert config.num_stages * tile * dtype.itemsize <= LDS_BUDGET
        assert not config.swap_ab and not config.paired  # Hopper's forms
    # Decode steps take short row blocks, prefill steps tall ones.
    rows_per_expert = tokens * top_k / experts
    assert up.block_m == (16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 128)


def test_refuses_other_architectures_and_fp8() -> None:
    with pytest.raises(ValueError, match="gfx"):
        fused_moe_config("sm90", 1, 128, 768, 2048, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3fnuz"):
        fused_moe_config("gfx942", 1, 128, 768, 2048, 8, torch.float8_e4m3fn)


def test_the_op_picks_this_rule_on_gfx() -> None:
    register_moe_configs("gfx", fused_moe_config)
    assert moe_configs("gfx942", 64, 128, 768, 2048, 8, torch.bfloat16) == fused_moe_config(
        "gfx942", 64, 128, 768, 2048, 8, torch.bfloat16
    )
