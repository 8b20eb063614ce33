"""Which layers the CUDA platform gives the one-row GEMV (kvik_cuda.linear, kvik_cuda.tuning)."""

from __future__ import annotations

from torch import nn

from kvik.layers.linear import Linear, MergedColumnLinear, QKVLinear
from kvik.triton_kernels.gemv import OneRowLinear
from kvik_cuda.linear import use_one_row_gemv
from kvik_cuda.tuning import GEMV_MAX_K, gemv_config


class Block(nn.Module):
    """Llama-3.1-8B's four projections, at a tenth of the width (shapes only matter here)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(409, 128, 4, 1)
        self.o_proj = Linear(512, 409)
        self.gate_up_proj = MergedColumnLinear(409, [9000, 9000])
        self.down_proj = Linear(GEMV_MAX_K + 1, 409)


def test_hopper_layers_with_short_inner_dimensions_take_the_gemv() -> None:
    block = Block()
    assert use_one_row_gemv(block, "sm90") == 3
    for layer in (block.qkv_proj, block.o_proj, block.gate_up_proj):
        assert isinstance(layer.kernel, OneRowLinear)
        assert layer.kernel.weight is layer.weight
    assert block.down_proj.kernel is None  # K past GEMV_MAX_K: cuBLAS
    # Wide layers take wide programs.
    assert block.gate_up_proj.kernel.config.block_n > block.o_proj.kernel.config.block_n


def test_unmeasured_architectures_and_prepared_layers_keep_their_kernels() -> None:
    block = Block()
    assert use_one_row_gemv(block, "sm100") == 0
    assert all(m.kernel is None for m in block.modules() if isinstance(m, Linear))
    marker = object.__new__(OneRowLinear)
    block.o_proj.kernel = marker
    assert use_one_row_gemv(block, "sm90") == 2
    assert block.o_proj.kernel is marker
    assert gemv_config("gfx942", 4096, 4096) is None
