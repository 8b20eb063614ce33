"""Skinny matrix products for decode batches: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias), for
M up to ``GEMV_MAX_ROWS``, reading the weight once in 16-byte rows.

At batch 1-8 a decode step is a pass over the weights: its time is bytes over bandwidth. cuBLAS
picks split-K kernels for the narrower layers (o_proj, qkv, down_proj of an 8B model), which then
need a second reduction kernel; this kernel gives each program ``BLOCK_N`` whole output columns
(the full K loop, fp32 sums), so a product is one launch. Reference: ``torch.nn.functional.linear``
(the sums' order differs, so bf16 results differ by rounding).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

GEMV_MAX_ROWS = 8


@triton.jit(do_not_specialize=["M"])
def gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] or unused
    out_ptr,  # [M, N]
    M,
    N,
    x_stride,
    w_stride,
    out_stride,
    K: tl.constexpr,  # a layer's constant: the loop's trip count is known at compile time
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    k_base = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, M_PAD)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + k_base
        k_valid = k < K
        w = tl.load(
            w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :],
            mask=n_valid[:, None] & k_valid[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        for m in tl.static_range(M_PAD):
            x = tl.load(x_ptr + m * x_stride + k, mask=k_valid & (m < M), other=0.0)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_stride + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & n_valid[None, :],
    )


@functools.cache
def gemv_config(n: int, k: int, m_pad: int) -> dict[str, int]:
    """BLOCK_N columns per program, BLOCK_K per step; enough programs to fill the GPU twice."""
    block_n = 16 if n >= 4096 else 8
    return {"BLOCK_N": block_n, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3}


def gemv(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, config: dict | None = None
) -> Tensor:
    """x [..., K] with at most GEMV_MAX_ROWS rows, weight [N, K] (rows contiguous) -> [..., N]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    assert m <= GEMV_MAX_ROWS and weight.stride(1) == 1 and x2.stride(-1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    m_pad = triton.next_power_of_2(m)
    cfg = dict(config or gemv_config(n, k, m_pad))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    gemv_kernel[grid](
        x2, weight, bias if bias is not None else weight, out, m, n, x2.stride(0),
        weight.stride(0), out.stride(0), K=k, HAS_BIAS=bias is not None, M_PAD=m_pad, **cfg,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
