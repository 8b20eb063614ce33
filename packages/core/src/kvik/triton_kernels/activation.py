"""SiLU-and-mul: silu(gate) * up for x [T, 2*I] holding gate then up. Reference:
``kvik.ops.silu_and_mul``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, x_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024
SILU_WARPS = 4


def silu_and_mul(x: Tensor) -> Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(inter, SILU_BLOCK))
        silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), inter, BLOCK=SILU_BLOCK, num_warps=SILU_WARPS
        )
    return out.view(*x.shape[:-1], inter)
