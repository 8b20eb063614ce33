"""The FP8 linear products of issue 14's contract for this platform: kvik's Triton kernels
(``kvik.triton_kernels.fp8_linear``) with the launch configuration ``kvik_cuda.tuning`` picks for
the GPU's architecture and the call's rows. The signatures are the contract's, so the quantization
methods call these as they call the PyTorch references on the CPU."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvik.triton_kernels import fp8_linear
from kvik.triton_kernels.activation import silu_and_mul_fp8_group_quant
from kvik.triton_kernels.attention import device_arch
from kvik.triton_kernels.fp8_skinny import Fp8SkinnyConfig
from kvik.triton_kernels.fp8_skinny_glu import (
    GLU_ENGINE_MAX_ROWS,
    fp8_skinny_glu_block_matmul,
    fuses_silu_and_mul,
    glu_config,
)
from kvik_cuda import tuning
from kvik_cuda.tuning import fp8_block_config, fp8_scaled_config


@functools.cache
def arch_of(device: torch.device) -> str:
    return device_arch(device)[0]


def fp8_block_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x [..., K] -> [..., N]: block FP8 (activations quantized per token group of 128 inside)."""
    n, k = weight.shape
    config = fp8_block_config(arch_of(x.device), x.numel() // max(k, 1), n, k)
    return fp8_linear.fp8_block_linear(x, weight, weight_scale, bias, config)


def fp8_block_linear_quantized(
    values: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """values e4m3 [..., K] with scales [..., ceil(K/128)] (quantized by their producer) ->
    [..., N]: the launch ``fp8_block_linear`` takes for these rows, on the quantized input."""
    n, k = weight.shape
    config = fp8_block_config(arch_of(values.device), values.numel() // max(k, 1), n, k)
    return fp8_linear.fp8_block_linear_quantized(
        values, scales, weight, weight_scale, bias, out_dtype, config
    )


def fp8_block_silu_and_mul_quantized(
    values: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """A gate/up product on quantized input, SiLU-and-mul, and down's quantization: one launch
    where the product's rows take the few-rows kernel, up to ``GLU_ENGINE_MAX_ROWS``
    (``fp8_skinny_glu_block_matmul``, with as many programs as that product's launch), else the
    product's launch and SiLU-and-mul's."""
    n, k = weight.shape
    rows = values.numel() // max(k, 1)
    config = fp8_block_config(arch_of(values.device), rows, n, k)
    if (
        tuning.FP8_GATE_UP_SILU
        and isinstance(config, Fp8SkinnyConfig)
        and values.dim() == 2
        and n % 2 == 0
        and rows <= GLU_ENGINE_MAX_ROWS
        and fuses_silu_and_mul(n // 2, rows)
    ):
        return fp8_skinny_glu_block_matmul(
            values, scales, weight, weight_scale, bias, out_dtype, glu_config(config, k)
        )
    gate_up = fp8_block_linear_quantized(values, scales, weight, weight_scale, bias, out_dtype)
    return silu_and_mul_fp8_group_quant(gate_up)


def fp8_scaled_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
) -> Tensor:
    """x [..., K] -> [..., N]: per-tensor or per-channel weight scales, a static activation scale
    or (None) dynamic per-token ones."""
    n, k = weight.shape
    config = fp8_scaled_config(arch_of(x.device), x.numel() // max(k, 1), n, k)
    return fp8_linear.fp8_scaled_linear(x, weight, weight_scale, input_scale, bias, config)
