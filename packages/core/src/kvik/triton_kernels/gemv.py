"""A one-row matrix product, ``out [1, N] = x [1, K] @ weight [N, K]^T (+ bias)``: a batch-1
decode step's projections, where the time is the weight's bytes over the memory bandwidth.

cuBLAS covers a narrow layer's weight with few tiles and adds split-K passes and a reduction
kernel to fill the GPU; here each program owns ``BLOCK_N`` whole output columns and loops over all
of K in fp32, so a product is one launch with no reduction. Long K loops with few programs hide
memory latency badly, so a platform uses this for short K only (``kvik_cuda.tuning.gemv_config``).
Reference: ``torch.nn.functional.linear`` (the sums' order differs: bf16 results differ by
rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.pdl import uses_pdl, wait_for_prior_kernel


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program
    block_k: int  # inner-dimension elements per loop step
    num_warps: int
    num_stages: int


@triton.jit
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
    K: tl.constexpr,  # a layer's constant: the loop's trip count is known when compiling
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    # Written for M_PAD rows although kvik calls it with one: this form (the sums gathered into
    # an [M_PAD, BLOCK_N] accumulator) compiled to a faster loop on the H200 than a plain
    # [BLOCK_N] one (docs/benchmarks.md).
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
            # (m < M) as a block, not a scalar: the interpreter of Triton 3.9 refuses a scalar mask.
            x_valid = k_valid & (tl.full([BLOCK_K], m, tl.int32) < M)
            x = tl.load(x_ptr + m * x_stride + k, mask=x_valid, other=0.0)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_stride + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & n_valid[None, :],
    )


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig) -> Tensor:
    """x [1, K] (contiguous), weight [N, K] (rows contiguous) -> [1, N] in x's dtype."""
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = uses_pdl(x.device)
    gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight if bias is None else bias, out, 1, n, x.stride(0), weight.stride(0),
        out.stride(0), K=k, HAS_BIAS=bias is not None, M_PAD=1, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, PDL=pdl, num_warps=config.num_warps,
        num_stages=config.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out


class OneRowLinear:
    """The GEMV for one-row inputs (a batch-1 decode step, eager or in its CUDA graph),
    ``F.linear`` for every other shape: the CUDA platform's unquantized kernel for the layers its
    tuning accepts (kvik_cuda.linear)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, config: GemvConfig) -> None:
        self.weight = weight
        self.bias = bias
        self.config = config

    def __call__(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous():
            return gemv(x, self.weight, self.bias, self.config)
        return F.linear(x, self.weight, self.bias)
