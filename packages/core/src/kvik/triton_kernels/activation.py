"""SiLU-and-mul: silu(gate) * up for x [T, 2*I] holding gate then up; optionally written quantized
per token group of 128 (e4m3 and fp32 scales) for a block-FP8 down projection
(kvik.quantization.activation), the result rounded to x's dtype first so that the values are those
``per_token_group_quant_fp8`` gives for the unquantized result. References:
``kvik.ops.silu_and_mul``, ``kvik.quantization.ops.silu_and_mul_fp8_group_quant``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP_SIZE,
    empty_group_scales,
    rounds_in_software,
    store_group_quantized,
)
from kvik.triton_kernels.pdl import uses_pdl, wait_for_prior_kernel


# rows changes with the batch: unspecialised, so a batch size of 1 compiles no variant of its own.
@triton.jit(do_not_specialize=["rows"])
def silu_and_mul_kernel(
    x_ptr,
    out_ptr,  # [T, I]: the result, or with QUANTIZE its e4m3 values
    scale_ptr,  # QUANTIZE: [T, ceil(I / GROUP)] fp32, tokens contiguous
    x_stride,
    rows,  # T: the stride between a token's scale groups
    inter,
    QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,  # QUANTIZE: see fp8_quant.rounds_in_software
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    if QUANTIZE:
        # A block holds whole groups (BLOCK is a multiple of GROUP): the unquantized result in
        # x's dtype, quantized.
        y = out.to(x_ptr.dtype.element_ty).to(tl.float32)
        store_group_quantized(
            y, out_ptr + row * inter, scale_ptr + row, rows, tl.program_id(1) * (BLOCK // GROUP),
            inter, BLOCK // GROUP, GROUP, ROUND_IN_SOFTWARE,
        )  # fmt: skip
    else:
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024
SILU_WARPS = 4


def _launch(x: Tensor, quantize: bool) -> tuple[Tensor, Tensor | None]:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    rows = x2.shape[0]
    scales = None
    if quantize:
        out = torch.empty(rows, inter, dtype=FP8_DTYPE, device=x.device)
        groups = triton.cdiv(inter, GROUP_SIZE)
        scales = empty_group_scales(rows, groups, x.device)
    else:
        out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows > 0:
        grid = (rows, triton.cdiv(inter, SILU_BLOCK))
        pdl = uses_pdl(x.device)
        silu_and_mul_kernel[grid](
            x2, out, out if scales is None else scales, x2.stride(0), rows, inter,
            QUANTIZE=quantize,
            BLOCK=SILU_BLOCK, GROUP=GROUP_SIZE, ROUND_IN_SOFTWARE=rounds_in_software(x.device),
            PDL=pdl, num_warps=SILU_WARPS, launch_pdl=pdl,
        )  # fmt: skip
    if scales is not None:
        scales = scales.view(*x.shape[:-1], scales.shape[-1])
    return out.view(*x.shape[:-1], inter), scales


def silu_and_mul(x: Tensor) -> Tensor:
    return _launch(x, quantize=False)[0]


def silu_and_mul_fp8_group_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """silu(gate) * up quantized per token group of 128: (e4m3 values, fp32 scales)."""
    out, scales = _launch(x, quantize=True)
    return out, scales
