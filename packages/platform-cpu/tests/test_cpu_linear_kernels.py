"""The CPU platform's linear kernels (CpuPlatform.linear_kernel): unquantized bf16 layers on packed
weights, everything else on core's PyTorch kernels; the one-call decode finds AMX-packed weights
through each layer's method."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvik.layers.embedding import LMHead
from kvik.layers.linear import Linear
from kvik.quantization.kernels import Fp8BlockKernel, Fp8ScaledKernel, TorchLinearKernel
from kvik_cpu import isa
from kvik_cpu.decode_layers import _amx_packed
from kvik_cpu.isa import CpuIsa
from kvik_cpu.linear import (
    AmxLinear,
    OneDnnLinear,
    PackedLinearKernel,
    packed_linear_kernel,
    packed_linear_supported,
)
from kvik_cpu.platform import CpuPlatform


def bf16_linear(bias: bool = True) -> Linear:
    with torch.device("cpu"):
        layer = Linear(96, 40, bias)
    layer.to(torch.bfloat16)
    for p in layer.parameters():
        nn.init.normal_(p)
    return layer


def test_the_packed_product_follows_the_kernel_path():
    layer = bf16_linear()
    assert packed_linear_kernel(layer, CpuIsa.PLAIN) is None  # F.linear
    if not packed_linear_supported(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 on this CPU")
    assert packed_linear_kernel(layer, CpuIsa.AVX512BF16).product_class is OneDnnLinear
    assert packed_linear_kernel(layer, CpuIsa.AMX).product_class is AmxLinear
    assert packed_linear_kernel(layer.float(), CpuIsa.AMX) is None  # fp32 keeps F.linear


def test_unquantized_bf16_layers_run_on_packed_weights_and_release_the_dense_copy():
    if isa.engine_isa() < CpuIsa.AVX512BF16 or not packed_linear_supported(torch.bfloat16):
        pytest.skip("this CPU's engine path keeps F.linear")
    layer, head = bf16_linear(), LMHead(50, 96).to(torch.bfloat16)
    nn.init.normal_(head.weight)
    x = torch.randn(5, 96).to(torch.bfloat16)
    want_layer = F.linear(x, layer.weight, layer.bias)
    want_head = F.linear(x, head.weight)
    for module in (layer, head):
        module.quant_method.process_weights_after_loading(module, CpuPlatform)
        assert isinstance(module.quant_method.kernel, PackedLinearKernel)
    assert layer.weight.numel() == 0  # only the packed copy is read
    assert head.weight.shape == (50, 96)  # an embedding may look tokens up in it
    tol = dict(rtol=1e-2, atol=1e-2)  # AMX sums in another order than F.linear
    torch.testing.assert_close(layer(x), want_layer, **tol)
    torch.testing.assert_close(head(x), want_head, **tol)


def test_other_schemes_and_dtypes_take_the_pytorch_kernels():
    layer = bf16_linear().float()
    assert type(CpuPlatform.linear_kernel("unquantized", layer)) is TorchLinearKernel
    assert type(CpuPlatform.linear_kernel("fp8_block", layer)) is Fp8BlockKernel
    assert type(CpuPlatform.linear_kernel("fp8_scaled", layer)) is Fp8ScaledKernel
    with pytest.raises(ValueError, match="unknown linear scheme 'int4'"):
        CpuPlatform.linear_kernel("int4", layer)


def test_the_decode_loop_reads_amx_weights_through_the_method():
    layer = bf16_linear()
    assert _amx_packed(layer) is None  # core's kernel: no packed weights
    kernel = PackedLinearKernel(AmxLinear)
    kernel.packed = object.__new__(AmxLinear)  # AMX packing needs the tiles; the type is the point
    layer.quant_method.kernel = kernel
    assert _amx_packed(layer) is kernel.packed
    kernel.packed = object.__new__(OneDnnLinear)
    assert _amx_packed(layer) is None
