"""RMSNorm and fused residual-add + RMSNorm, one program per token row; optionally writing the
result quantized per token group of 128 (e4m3 and fp32 scales) for a block-FP8 linear layer
(kvik.quantization.activation): the result is rounded to its dtype first, so the values are those
``per_token_group_quant_fp8`` gives for the unquantized result.

References: ``kvik.ops.rms_norm`` and ``kvik.ops.fused_add_rms_norm`` (normalise in fp32, round to
the input dtype, then scale by the weight), ``kvik.quantization.ops.rms_norm_fp8_group_quant``
and ``fused_add_rms_norm_fp8_group_quant``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP_SIZE,
    empty_group_scales,
    per_token_group_quant_fp8,
    rounds_in_software,
    store_group_quantized,
)
from kvik.triton_kernels.pdl import uses_pdl, wait_for_prior_kernel


# rows changes with the batch: unspecialised, so a batch size of 1 compiles no variant of its own.
@triton.jit(do_not_specialize=["rows"])
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,  # [T, hidden]: the result, or with QUANTIZE its e4m3 values
    summed_ptr,
    scale_ptr,  # QUANTIZE: [T, ceil(hidden / GROUP)] fp32, tokens contiguous
    x_stride,
    residual_stride,
    rows,  # T: the stride between a token's scale groups
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,  # QUANTIZE: see fp8_quant.rounds_in_software
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the input dtype first: it is the next layer's residual.
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        y = (w * normed).to(x.dtype).to(tl.float32)  # the unquantized result, then quantized
        store_group_quantized(
            y, out_ptr + row * hidden, scale_ptr + row, rows, 0, hidden, BLOCK // GROUP, GROUP,
            ROUND_IN_SOFTWARE,
        )  # fmt: skip
    else:
        tl.store(
            out_ptr + row * hidden + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
        )


def rms_norm_config(hidden: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the whole row in one block, 16-byte loads per thread or more."""
    block = triton.next_power_of_2(hidden)
    return block, min(max(block // 256, 1), 16)


def _launch(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, quantize: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(result or its e4m3 values, x + residual (or the result), the scales where quantized)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    block, num_warps = rms_norm_config(hidden)
    # A row narrower than a quantization group takes a group's block in both launches: the
    # quantizing one needs it, and the plain one then sums the squares in the same order, so
    # that the quantized result is the plain result quantized, bit for bit (with 64 lanes against
    # 128 the sums' orders differed, and now and then the last bit of the rstd).
    block = max(block, GROUP_SIZE)
    scales = None
    if quantize:
        out = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
        scales = empty_group_scales(x2.shape[0], triton.cdiv(hidden, GROUP_SIZE), x.device)
    else:
        out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    if x2.shape[0] > 0:
        pdl = uses_pdl(x.device)
        rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, summed, out if scales is None else scales, x2.stride(0),
            res2.stride(0), x2.shape[0], hidden, eps, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize,
            BLOCK=block, GROUP=GROUP_SIZE, ROUND_IN_SOFTWARE=rounds_in_software(x.device),
            PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
        )  # fmt: skip
    if scales is not None:
        scales = scales.view(*x.shape[:-1], scales.shape[-1])
    return out.view(x.shape), summed.view(x.shape), scales


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., hidden] (last dim contiguous) -> rms_norm(x) * weight."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual)."""
    out, summed, _ = _launch(x, residual, weight, eps)
    return out, summed


def _quantizes_in_kernel(x: Tensor, weight: Tensor) -> bool:
    # The kernel rounds to x's dtype before quantizing; a weight of another dtype makes the
    # result another dtype (torch's promotion), so that rare case takes the two launches.
    return weight.dtype == x.dtype


def rms_norm_fp8_group_quant(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """rms_norm(x) * weight quantized per token group of 128: (e4m3 values, fp32 scales)."""
    if not _quantizes_in_kernel(x, weight):
        return per_token_group_quant_fp8(rms_norm(x, weight, eps), column_major_scales=True)
    out, _, scales = _launch(x, None, weight, eps, quantize=True)
    return out, scales


def fused_add_rms_norm_fp8_group_quant(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(values, scales) of rms_norm(x + residual) * weight quantized per token group, and
    x + residual."""
    if not _quantizes_in_kernel(x, weight):
        out, summed = fused_add_rms_norm(x, residual, weight, eps)
        return (*per_token_group_quant_fp8(out, column_major_scales=True), summed)
    out, summed, scales = _launch(x, residual, weight, eps, quantize=True)
    return out, scales, summed


@triton.jit
def _store_normed(x, weight_ptr, out_ptr, cols, mask, hidden, eps):
    # As rms_norm_kernel: normalise in fp32, round to x's dtype, scale by the weight.
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def embed_rms_norm_cat_kernel(
    token_ids_ptr,  # [T] int64
    embedding_ptr,  # [V, hidden]
    hidden_ptr,  # [T, hidden]
    embed_norm_weight_ptr,
    hidden_norm_weight_ptr,
    out_ptr,  # [T, 2 * hidden]
    embedding_stride,
    hidden_stride,
    hidden,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    # The embedding row in the hidden states' dtype first, as the reference casts it.
    h = tl.load(hidden_ptr + row * hidden_stride + cols, mask=mask, other=0.0)
    e = tl.load(embedding_ptr + token * embedding_stride + cols, mask=mask, other=0.0).to(h.dtype)
    out_row = out_ptr + row * 2 * hidden
    _store_normed(e, embed_norm_weight_ptr, out_row, cols, mask, hidden, eps)
    _store_normed(h, hidden_norm_weight_ptr, out_row + hidden, cols, mask, hidden, eps)


def embed_rms_norm_cat(
    token_ids: Tensor,
    embedding: Tensor,
    hidden: Tensor,
    embed_norm_weight: Tensor,
    hidden_norm_weight: Tensor,
    eps: float,
) -> Tensor:
    """An EAGLE-3 layer's attention input in one launch (``kvik.ops.embed_rms_norm_cat``): the
    embedding lookup, both RMSNorms and their concatenation, where the reference takes five."""
    size = hidden.shape[-1]
    hidden2 = hidden.reshape(-1, size)
    if hidden2.stride(-1) != 1:
        hidden2 = hidden2.contiguous()
    if embedding.stride(-1) != 1:
        embedding = embedding.contiguous()
    dtype = torch.result_type(hidden_norm_weight, hidden)
    out = torch.empty(hidden2.shape[0], 2 * size, dtype=dtype, device=hidden.device)
    block, num_warps = rms_norm_config(size)
    if hidden2.shape[0] > 0:
        embed_rms_norm_cat_kernel[(hidden2.shape[0],)](
            token_ids.reshape(-1), embedding, hidden2, embed_norm_weight, hidden_norm_weight, out,
            embedding.stride(0), hidden2.stride(0), size, eps, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return out.view(*hidden.shape[:-1], 2 * size)
