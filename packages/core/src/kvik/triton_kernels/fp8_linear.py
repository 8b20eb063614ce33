"""The FP8 linear products of issue 14's contract on Triton GPUs, activations quantized inside:

- ``fp8_block_linear``: block FP8 (per-token-group activations, 128 x 128 weight blocks);
- ``fp8_scaled_linear``: per-tensor or per-channel weights, static per-tensor or dynamic per-token
  activations.

Both take ``x [..., K]`` and return ``[..., N]`` in x's dtype. The launch configuration is the
platform's choice, made per call from the rows (``kvik_cuda.tuning``); the PyTorch references of the
same numerics are the CPU path (``kvik.quantization``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvik.triton_kernels.fp8_gemm import (
    Fp8GemmConfig,
    Fp8GemvConfig,
    check_bias,
    check_block_weight_scale,
    check_weight,
    fp8_block_gemv_quantized,
    fp8_block_matmul,
    fp8_gemm,
)
from kvik.triton_kernels.fp8_quant import (
    SCALE_FLOOR,
    as_rows,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
)
from kvik.triton_kernels.fp8_skinny import (
    Fp8SkinnyConfig,
    fp8_skinny_block_matmul,
    fp8_skinny_block_matmul_quantized,
    fp8_skinny_scaled_matmul,
)


@dataclass(frozen=True)
class CublasBlockwise:
    """Run a block-FP8 product on cuBLAS's blockwise scaling (``torch.nn.functional.scaled_mm``
    with 1x128 activation and 128x128 weight scales) where it takes the case, else on the Triton
    tiled kernel with ``fallback``. It takes bf16 activations on a CUDA device with N a multiple of
    128 and K of 512 (the weight scales' K blocks, cuBLAS's scale rows, in fours)."""

    fallback: Fp8GemmConfig


def cublas_blockwise_takes(x: Tensor, weight: Tensor, weight_scale: Tensor) -> bool:
    n, k = weight.shape
    return (
        hasattr(F, "scaled_mm")
        and hasattr(F, "ScalingType")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and x.shape[0] > 0
        and n % 128 == 0
        and k % 512 == 0
        and weight_scale.is_contiguous()
    )


def cublas_block_matmul(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x bf16 [M, K] -> [M, N] on cuBLAS: activation scales written column-major (tokens
    contiguous) and the weight scales transposed, the layouts it takes; the bias added after.

    cuBLAS refuses (CUBLAS_STATUS_NOT_SUPPORTED) the blockwise product when M is not a multiple of
    4, as the H200 showed for every such M from 1 to 257 (docs/benchmarks.md), and torch insists
    that the column-major scales' stride is M itself, so such inputs get zero rows appended (their
    scales are those of zeros) and the result drops them."""
    m = x.shape[0]
    padded = x if m % CUBLAS_BLOCKWISE_ROW_MULTIPLE == 0 else F.pad(
        x, (0, 0, 0, -m % CUBLAS_BLOCKWISE_ROW_MULTIPLE)
    )  # fmt: skip
    q, scales = per_token_group_quant_fp8(padded, column_major_scales=True)
    out = F.scaled_mm(
        q, weight.t(), scales, F.ScalingType.BlockWise1x128, weight_scale.t(),
        F.ScalingType.BlockWise128x128, output_dtype=x.dtype,
    )  # fmt: skip
    out = out if padded is x else out[:m]
    return out if bias is None else out.add_(bias)


#: cuBLAS's blockwise-scaled products take row counts in fours only.
CUBLAS_BLOCKWISE_ROW_MULTIPLE = 4


def fp8_block_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    config: Fp8GemmConfig | Fp8GemvConfig | Fp8SkinnyConfig | CublasBlockwise,
) -> Tensor:
    """x [..., K] -> [..., N]; weight e4m3 [N, K], weight_scale fp32 [ceil(N/128), ceil(K/128)]
    (multiplied: w = q * scale). An ``Fp8SkinnyConfig`` runs the few-rows tensor-core kernel
    (``kvik.triton_kernels.fp8_skinny``, up to 64 rows), an ``Fp8GemvConfig`` the few-rows
    CUDA-core kernel, an ``Fp8GemmConfig`` the group quantization and the tiled kernel, a
    ``CublasBlockwise`` cuBLAS where it takes the case."""
    rows = as_rows(x)
    if isinstance(config, Fp8SkinnyConfig):
        out = fp8_skinny_block_matmul(rows, weight, weight_scale, bias, config)
        return out.view(*x.shape[:-1], out.shape[-1])
    if isinstance(config, CublasBlockwise):
        n = check_weight(weight, rows.shape[1])
        check_block_weight_scale(weight_scale, n, rows.shape[1])
        check_bias(bias, n)
        if cublas_blockwise_takes(rows, weight, weight_scale):
            out = cublas_block_matmul(rows, weight, weight_scale, bias)
            return out.view(*x.shape[:-1], n)
        config = config.fallback
    out = fp8_block_matmul(rows, weight, weight_scale, bias, config)
    return out.view(*x.shape[:-1], out.shape[-1])


def fp8_block_linear_quantized(
    q: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig | Fp8GemvConfig | Fp8SkinnyConfig | CublasBlockwise,
) -> Tensor:
    """``fp8_block_linear`` on activations their producer quantized per token group
    (kvik.quantization.activation): e4m3 ``q`` [..., K] and fp32 ``scales`` [..., ceil(K/128)]
    (row-major, or tokens contiguous as the producers write them) -> [..., N] in ``out_dtype``,
    by the kernel ``config`` names, reading the activations as they are (a configuration that
    quantizes inside takes its prequantized launch)."""
    k = q.shape[-1]
    rows = q.reshape(-1, k)
    row_scales = scales.reshape(rows.shape[0], -1)  # either order: every kernel takes both strides
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if isinstance(config, Fp8SkinnyConfig):
        out = fp8_skinny_block_matmul_quantized(
            rows, row_scales, weight, weight_scale, bias, out_dtype, config
        )
    elif isinstance(config, Fp8GemvConfig):
        out = fp8_block_gemv_quantized(
            rows, row_scales, weight, weight_scale, bias, out_dtype, config
        )
    else:
        if isinstance(config, CublasBlockwise):
            n = check_weight(weight, k)
            check_block_weight_scale(weight_scale, n, k)
            check_bias(bias, n)
            if cublas_blockwise_takes_quantized(rows, weight, weight_scale, out_dtype):
                out = cublas_block_matmul_quantized(
                    rows, row_scales, weight, weight_scale, bias, out_dtype
                )
                return out.view(*q.shape[:-1], n)
            config = config.fallback
        out = fp8_gemm(
            rows, weight, row_scales, weight_scale, bias, out_dtype, config, block_scales=True
        )
    return out.view(*q.shape[:-1], out.shape[-1])


def cublas_blockwise_takes_quantized(
    q: Tensor, weight: Tensor, weight_scale: Tensor, out_dtype: torch.dtype
) -> bool:
    """``cublas_blockwise_takes`` for activations already quantized (a bf16 output)."""
    n, k = weight.shape
    return (
        hasattr(F, "scaled_mm")
        and hasattr(F, "ScalingType")
        and q.is_cuda
        and out_dtype == torch.bfloat16
        and q.shape[0] > 0
        and n % 128 == 0
        and k % 512 == 0
        and weight_scale.is_contiguous()
    )


def cublas_block_matmul_quantized(
    q: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """``cublas_block_matmul`` on quantized rows: the rows padded to a multiple of 4 with zeros
    (their scales the floor, as zeros quantize) and the scales column-major, the layout cuBLAS
    takes. The producers write them so (``empty_group_scales``): where no row is padded (a
    decode step's usual case) they are read in place; row-major scales take one copy (before the
    producers wrote that layout, 96 copies a Llama-3.1-8B step, 1.8% of its kernels' time on the
    H200 at 256 rows)."""
    m = q.shape[0]
    padded = -(-m // CUBLAS_BLOCKWISE_ROW_MULTIPLE) * CUBLAS_BLOCKWISE_ROW_MULTIPLE
    if padded == m:
        columns = scales.t().contiguous()  # no copy for the producers' layout
    else:
        q = torch.cat([q, q.new_zeros(padded - m, q.shape[1])])
        columns = F.pad(scales.t(), (0, padded - m), value=SCALE_FLOOR)
    out = F.scaled_mm(
        q, weight.t(), columns.t(), F.ScalingType.BlockWise1x128, weight_scale.t(),
        F.ScalingType.BlockWise128x128, output_dtype=out_dtype,
    )  # fmt: skip
    out = out if padded == m else out[:m]
    return out if bias is None else out.add_(bias)


def fp8_scaled_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    config: Fp8GemmConfig | Fp8SkinnyConfig,
    use_scaled_mm: bool = True,
) -> Tensor:
    """x [..., K] -> [..., N]; weight e4m3 [N, K], weight_scale fp32 [1] or [N], input_scale fp32
    [1] (static) or None (dynamic per-token scales).

    The activations are quantized by ``per_token_quant_fp8``; the product runs on
    ``torch._scaled_mm`` (cuBLAS / CUTLASS) where it takes the case, else on the Triton tiled kernel
    with per-channel scales (``config``). ``torch._scaled_mm`` takes it on a CUDA device when K and
    N are multiples of 16 and either
    - both scales are one element (tensor-wise scaling; any output dtype), or
    - the output is bf16 (row-wise scaling: activation scales expanded to [M, 1], weight scales
      to [1, N]; Hopper's row-wise kernel writes bf16 only).
    So fp16 and fp32 activations with a per-token or per-channel scale, K or N not a multiple of 16,
    and CPU tensors (the Triton interpreter) take the Triton kernel; so does ``use_scaled_mm``
    False. A bias joins ``torch._scaled_mm``'s call where the output is bf16 or fp16 (it refuses
    one with an fp32 output); else it is added after, in fp32. An ``Fp8SkinnyConfig`` (up to 64
    rows) runs the few-rows tensor-core kernel instead of either."""
    rows = as_rows(x)
    if isinstance(config, Fp8SkinnyConfig):
        out = fp8_skinny_scaled_matmul(rows, weight, weight_scale, input_scale, bias, config)
        return out.view(*x.shape[:-1], out.shape[-1])
    m, k = rows.shape
    n = check_weight(weight, k)
    check_bias(bias, n)
    if weight_scale.dtype != torch.float32 or weight_scale.numel() not in (1, n):
        raise ValueError(
            f"weight scales must be fp32 with 1 or {n} elements, "
            f"not {weight_scale.dtype} of shape {tuple(weight_scale.shape)}"
        )
    q, a_scale = per_token_quant_fp8(rows, input_scale)
    tensor_wise = a_scale.numel() == 1 and weight_scale.numel() == 1
    if (
        use_scaled_mm
        and x.is_cuda
        and k % 16 == 0
        and n % 16 == 0
        and m > 0
        and (tensor_wise or x.dtype == torch.bfloat16)
    ):
        out = scaled_mm(q, weight, a_scale, weight_scale, bias, x.dtype, tensor_wise)
    else:
        out = fp8_gemm(q, weight, a_scale, weight_scale, bias, x.dtype, config, block_scales=False)
    return out.view(*x.shape[:-1], n)


def scaled_mm(
    q: Tensor,
    weight: Tensor,
    a_scale: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    tensor_wise: bool,
) -> Tensor:
    m, n = q.shape[0], weight.shape[0]
    if tensor_wise:
        scale_a, scale_b = a_scale.reshape(()), weight_scale.reshape(())
    else:
        scale_a = a_scale.reshape(-1, 1).expand(m, 1).contiguous()
        scale_b = weight_scale.reshape(1, -1).expand(1, n).contiguous()
    fused_bias = None if bias is None or out_dtype == torch.float32 else bias.to(out_dtype)
    out = torch._scaled_mm(
        q, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=fused_bias, out_dtype=out_dtype
    )
    if bias is not None and fused_bias is None:
        out += bias
    return out
