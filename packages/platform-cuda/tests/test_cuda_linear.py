"""Which layers the CUDA platform's unquantized kernel puts on the one-row GEMV
(kvik_cuda.linear, kvik_cuda.tuning), and the LM head's fp32 logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvik.layers.embedding import LMHead
from kvik.layers.linear import Linear, MergedColumnLinear, QKVLinear
from kvik.triton_kernels.gemv import OneRowLinear
from kvik_cuda import fp8
from kvik_cuda.linear import Fp32LogitsKernel, OneRowGemvKernel, one_row_gemv_kernel
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
    kernels = {name: one_row_gemv_kernel(layer, "sm90") for name, layer in block.named_children()}
    assert kernels["down_proj"] is None  # K past GEMV_MAX_K: cuBLAS
    for name in ("qkv_proj", "o_proj", "gate_up_proj"):
        kernel, layer = kernels[name], getattr(block, name)
        assert isinstance(kernel, OneRowGemvKernel)
        kernel.process_weights_after_loading(layer)
        assert isinstance(kernel.product, OneRowLinear)
        assert kernel.product.weight is layer.weight  # read in place
    # Wide layers take wide programs.
    assert kernels["gate_up_proj"].config.block_n > kernels["o_proj"].config.block_n


def test_unmeasured_architectures_and_the_lm_head_stay_on_cublas() -> None:
    block = Block()
    assert all(one_row_gemv_kernel(layer, "sm100") is None for layer in block.children())
    assert one_row_gemv_kernel(LMHead(1000, 409), "sm90") is None
    assert gemv_config("gfx942", 4096, 4096) is None


def test_the_gemv_kernel_computes_the_layer_product_on_other_shapes() -> None:
    """Rows that are not one contiguous row fall back to F.linear inside the kernel."""
    layer = Linear(16, 8, bias=True)
    nn.init.normal_(layer.weight)
    nn.init.normal_(layer.bias)
    kernel = one_row_gemv_kernel(layer, "sm90")
    kernel.process_weights_after_loading(layer)
    x = torch.randn(3, 16)
    torch.testing.assert_close(kernel.apply(layer, x), layer(x))


def test_fp8_schemes_run_on_kvik_cudas_kernels() -> None:
    """The FP8 schemes' kernels call the custom ops torch.ops.kvik.fp8_*_linear (opaque to
    torch.compile), whose CUDA implementations are kvik_cuda.fp8's (Triton and cuBLAS's scaled
    products) once the platform is selected."""
    from kvik.quantization.kernels import Fp8BlockKernel, Fp8ScaledKernel
    from kvik_cuda.platform import CudaPlatform
    from kvik_cuda.registration import KERNELS

    layer = Linear(256, 256)
    block = CudaPlatform.linear_kernel("fp8_block", layer)
    scaled = CudaPlatform.linear_kernel("fp8_scaled", layer)
    assert isinstance(block, Fp8BlockKernel) and block.function is torch.ops.kvik.fp8_block_linear
    assert isinstance(scaled, Fp8ScaledKernel)
    assert scaled.function is torch.ops.kvik.fp8_scaled_linear
    assert KERNELS["kvik::fp8_block_linear"] is fp8.fp8_block_linear
    assert KERNELS["kvik::fp8_scaled_linear"] is fp8.fp8_scaled_linear


def test_a_16_bit_lm_head_writes_fp32_logits() -> None:
    """A bf16 or fp16 LM head takes the fp32-output kernel (torch.mm's out_dtype on CUDA); an
    fp32 one and the other layers do not."""
    from kvik_cuda.platform import CudaPlatform

    head = LMHead(1000, 409).to(torch.bfloat16)
    assert isinstance(CudaPlatform.linear_kernel("unquantized", head), Fp32LogitsKernel)
    assert isinstance(
        CudaPlatform.linear_kernel("unquantized", LMHead(1000, 409).half()), Fp32LogitsKernel
    )
    assert not isinstance(
        CudaPlatform.linear_kernel("unquantized", LMHead(1000, 409)), Fp32LogitsKernel
    )
    assert not isinstance(
        CudaPlatform.linear_kernel("unquantized", Linear(512, 409).to(torch.bfloat16)),
        Fp32LogitsKernel,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's fp32-output product")
@pytest.mark.parametrize("rows", [1, 3, 256])
def test_fp32_logits_are_the_unrounded_sums(rows: int) -> None:
    head = LMHead(50_000, 4096).to("cuda", torch.bfloat16)
    nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    logits = Fp32LogitsKernel().apply(head, hidden)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 50_000)
    exact = hidden.double() @ head.weight.double().t()
    rounded = (hidden @ head.weight.t()).double()
    # Closer to the exact sums than bf16's rounding of them.
    assert (logits.double() - exact).abs().max() < (rounded - exact).abs().max()
    # Written into a buffer's leading rows (the CUDA graphs' shared logits): the same bits.
    buffer = torch.full((rows + 5, 50_000), float("nan"), device="cuda")
    into = Fp32LogitsKernel().apply_into(head, hidden, buffer[:rows])
    assert into.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:rows], logits) and buffer[rows:].isnan().all()
