"""RMSNorm and fused residual-add + RMSNorm, one program per token row.

References: ``kvik.ops.rms_norm`` and ``kvik.ops.fused_add_rms_norm`` (normalise in fp32, round to
the input dtype, then scale by the weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    x_stride,
    residual_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
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
    tl.store(out_ptr + row * hidden + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_config(hidden: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the whole row in one block, 16-byte loads per thread or more."""
    block = triton.next_power_of_2(hidden)
    return block, min(max(block // 256, 1), 16)


def _launch(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    block, num_warps = rms_norm_config(hidden)
    if x2.shape[0] > 0:
        rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, summed, x2.stride(0), res2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., hidden] (last dim contiguous) -> rms_norm(x) * weight."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual)."""
    return _launch(x, residual, weight, eps)
