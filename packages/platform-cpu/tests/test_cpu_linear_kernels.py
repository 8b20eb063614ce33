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
    Avx512Bf16Linear,
    OneDnnLinear,
    PackedLinearKernel,
    avx512_bf16_linear_runs,
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
    # AVX512-BF16 products where the C++ ops built, oneDNN's otherwise.
    without_amx = Avx512Bf16Linear if avx512_bf16_linear_runs() else OneDnnLinear
    assert packed_linear_kernel(layer, CpuIsa.AVX512BF16).product_class is without_amx
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
    # logits in fp32 on Avx512Bf16Linear (test_lm_head_logits_keep_the_fp32_sums...), else bf16
    torch.testing.assert_close(head(x).float(), want_head.float(), **tol)


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


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 1024, 512), (3, 100, 70), (8, 512, 512), (13, 40, 33), (0, 64, 64)])  # fmt: skip
def test_avx512_bf16_linear_against_fp32(rows: int, out_features: int, in_features: int) -> None:
    """The AVX512-BF16 product (the dense layers' and experts' kernel without AMX): fp32 sums of
    the bf16 values, rounded once to bf16 (or not: fp32_out); any column and K count (padding), with and without a bias; a row's
    result the same whatever rows share the call."""
    if not avx512_bf16_linear_runs():
        pytest.skip("kvik_cpu's C++ ops did not build with AVX512-BF16 here")
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    for b in (None, bias):
        product = Avx512Bf16Linear(weight, b)
        got = product(x)
        want = x.float() @ weight.float().T + (0 if b is None else b.float())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # One bf16 rounding of an fp32 sum: half a bf16 step of the largest output at most.
        if rows:
            assert (got.float() - want).abs().max() <= 2**-8 * want.abs().max()
            assert torch.equal(product(x[-1:])[0], got[-1])
        # fp32_out (the LM head's logits): the same sums unrounded; rounded, the bf16 result.
        sums = Avx512Bf16Linear(weight, b, fp32_out=True)(x)
        assert sums.dtype == torch.float32 and sums.shape == (rows, out_features)
        assert torch.equal(sums.to(torch.bfloat16), got)
        if rows:
            assert (sums - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.kvik_cpu.bf16_linear(x, product.weight, out_features + 64, None)


def test_lm_head_logits_keep_the_fp32_sums_so_close_logits_do_not_tie():
    """The default model's first token for "What is the capital of France?" in bf16: "The"
    (id 504) at logit 25.55, "L" (id 60) at 25.48 (fp32 sums of the AVX512-BF16 path's hidden
    state). Rounded to bf16 (a step of 0.125 there) both are 25.5, and greedy argmax then takes
    the lower id: "L'Étoile, la Marseillaise, ...". The LM head returns its fp32 sums instead."""
    if not avx512_bf16_linear_runs():
        pytest.skip("kvik_cpu's C++ ops did not build with AVX512-BF16 here")
    head = LMHead(640, 96).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[504, :2] = torch.tensor([25.5, 0.05])  # 25.5500
        head.weight[60, :2] = torch.tensor([25.5, -0.02])  # 25.4800
    x = torch.ones(1, 96, dtype=torch.bfloat16)
    want = F.linear(x.float(), head.weight.float())
    assert want[0, 504].to(torch.bfloat16) == want[0, 60].to(torch.bfloat16)  # the tie
    head.quant_method.kernel = kernel = PackedLinearKernel(Avx512Bf16Linear)
    kernel.process_weights_after_loading(head)
    logits = head(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    assert int(logits.argmax()) == 504
