"""FP8 (e4m3) matrix products with scales: ``out [M, N] = dequant(a) @ dequant(w)^T (+ bias)``,
accumulated in fp32, written in the activations' dtype.

Two scale schemes (issue 14's contract):
- block (``BLOCK_SCALES``): activation scales per token and group of 128 features [M, K/128],
  weight scales per 128 x 128 block [N/128, K/128]; a K step is one group, so each step's product
  is scaled by one activation scale per row and one weight scale per column before it joins the
  fp32 sum. Hopper's fp8 tensor cores add with less than fp32 precision, so summing at most 128
  products on them before the fp32 sum also bounds that error.
- per channel: activation scales per token [M] or one for all (stride 0), weight scales per output
  channel [N] or one (stride 0), applied once at the end.

Two kernels:
- ``fp8_gemm_kernel``, tiled on the tensor cores, for the activations quantized beforehand
  (``kvik.triton_kernels.fp8_quant``), with a grouped tile order so that programs running together
  share A and W tiles in L2.
- ``fp8_block_gemv_kernel`` for a few rows (batch-1 and small-batch decode), where the time is the
  weight's bytes over the memory bandwidth: like ``kvik.triton_kernels.gemv``, a program owns
  ``BLOCK_N`` output columns and walks all of K. It can quantize the activations itself (each
  program recomputes the few rows' groups, which are in L2), so a projection is one launch, or
  read them quantized by a launch of their own (``Fp8GemvConfig.prequantize``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP_SIZE,
    dynamic_scale,
    per_token_group_quant_fp8,
    quantize_to_grid,
)
from kvik.triton_kernels.pdl import uses_pdl, wait_for_prior_kernel


@dataclass(frozen=True)
class Fp8GemmConfig:
    """The tiled kernel's launch: ``block_m`` x ``block_n`` output tiles (K steps of 128), tiles
    ordered in bands of ``group_m`` tile rows."""

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Fp8GemvConfig:
    """The few-rows kernel's launch: ``block_n`` output columns a program, ``groups`` groups of 128
    features a K step; inputs of more than ``max_rows`` rows are refused (the work on the CUDA
    cores grows with the rows, while the tensor cores' does not). ``prequantize``: the
    activations quantized by their own launch first, rather than by every program again (which
    costs arithmetic a weight in proportion to 1 / block_n, and saves a launch)."""

    block_n: int
    groups: int
    max_rows: int
    num_warps: int
    num_stages: int
    prequantize: bool = False


@triton.jit
def fp8_gemm_kernel(
    a_ptr,  # [M, K] e4m3, K contiguous
    w_ptr,  # [N, K] e4m3, K contiguous
    a_scale_ptr,  # block: [M, ceil(K/128)]; per channel: [M] or [1]
    w_scale_ptr,  # block: [ceil(N/128), ceil(K/128)]; per channel: [N] or [1]
    bias_ptr,  # [N] or unused
    out_ptr,  # [M, N]
    M,
    N,
    a_stride,
    w_stride,
    out_stride,
    a_scale_stride,  # between rows' scales (0: one scale for all)
    a_scale_group_stride,  # block: between a row's groups (1 row-major, M the producers' layout)
    w_scale_stride,  # between weight-scale rows (block) or channels (0: one scale for all)
    K: tl.constexpr,  # a layer's constant: the loop's trip count, and whether K needs masks
    BLOCK_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 128: one scale group a step
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    band_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_rows
    pid_n = (pid % band) // band_rows

    # Rows and columns past the edge wrap around to valid ones: their loads need no masks, and
    # their results are never stored.
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * a_stride + k[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * w_stride + k[:, None]  # [BLOCK_K, BLOCK_N]
    a_scale_ptrs = a_scale_ptr + rows * a_scale_stride
    if BLOCK_SCALES:
        w_scale_ptrs = w_scale_ptr + (cols // BLOCK_K) * w_scale_stride
        # Where the tile's columns lie in one weight-scale block (BLOCK_N divides 128), one
        # weight scale serves the tile: a step's scaling is then one multiply-add an element.
        w_scale_block_ptr = w_scale_ptr + (pid_n * BLOCK_N // BLOCK_K) * w_scale_stride
    else:
        w_scale_ptrs = w_scale_ptr + cols * w_scale_stride

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_valid = k < K - k0
            a = tl.load(a_ptrs, mask=k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_valid[:, None], other=0.0)
        if BLOCK_SCALES:
            a_scale = tl.load(a_scale_ptrs + (k0 // BLOCK_K) * a_scale_group_stride)
            if BLOCK_K % BLOCK_N == 0:
                w_scale = tl.load(w_scale_block_ptr + k0 // BLOCK_K)
                acc += tl.dot(a, w) * (a_scale * w_scale)[:, None]
            else:
                w_scale = tl.load(w_scale_ptrs + k0 // BLOCK_K)
                acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc = acc * tl.load(a_scale_ptrs)[:, None] * tl.load(w_scale_ptrs)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]

    out_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(
        out_ptr + out_rows[:, None].to(tl.int64) * out_stride + out_cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(out_rows[:, None] < M) & (out_cols[None, :] < N),
    )


@triton.jit
def fp8_block_gemv_kernel(
    x_ptr,  # [M, K], K contiguous: bf16/fp16/fp32, or e4m3 where PREQUANTIZED
    x_scale_ptr,  # PREQUANTIZED: [M, ceil(K/128)] fp32, either order; else unused
    w_ptr,  # [N, K] e4m3, K contiguous
    w_scale_ptr,  # [ceil(N/128), ceil(K/128)] fp32
    bias_ptr,  # [N] or unused
    out_ptr,  # [M, N]
    M,
    N,
    x_stride,
    x_scale_stride,
    x_scale_group_stride,
    w_stride,
    w_scale_stride,
    out_stride,
    K: tl.constexpr,  # a layer's constant: the loop's trip count is known when compiling
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,  # groups of GROUP features a K step
    GROUP: tl.constexpr,
    PREQUANTIZED: tl.constexpr,
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    group_base = tl.arange(0, GROUPS)
    within = tl.arange(0, GROUP)
    out_rows = tl.arange(0, M_PAD)
    w_rows = w_ptr + n[:, None, None].to(tl.int64) * w_stride
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, GROUPS * GROUP):
        group = k0 // GROUP + group_base  # [GROUPS]
        k = group[:, None] * GROUP + within[None, :]  # [GROUPS, GROUP]
        k_valid = k < K
        w = tl.load(
            w_rows + k[None, :, :], mask=n_valid[:, None, None] & k_valid[None, :, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, GROUPS, GROUP]
        w_scale = tl.load(
            w_scale_ptr + (n[:, None] // GROUP) * w_scale_stride + group[None, :],
            mask=n_valid[:, None] & (group * GROUP < K)[None, :],
            other=0.0,
        )  # [BLOCK_N, GROUPS]
        for m in tl.static_range(M_PAD):
            # (m < M) as a block, not a scalar: the interpreter of Triton 3.9 refuses a scalar mask.
            x_valid = k_valid & (tl.full([GROUPS, GROUP], m, tl.int32) < M)
            x = tl.load(x_ptr + m * x_stride + k, mask=x_valid, other=0.0).to(tl.float32)
            if PREQUANTIZED:
                q = x
                x_scale = tl.load(
                    x_scale_ptr + m * x_scale_stride + group * x_scale_group_stride,
                    mask=(group * GROUP < K) & (tl.full([GROUPS], m, tl.int32) < M),
                    other=0.0,
                )  # [GROUPS]
            else:
                x_scale = dynamic_scale(tl.max(tl.abs(x), axis=1))  # [GROUPS]
                q = quantize_to_grid(x, x_scale[:, None])  # e4m3 values, exact in fp32
            part = tl.sum(w * q[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
            part = tl.sum(part * w_scale * x_scale[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(out_rows[:, None] == m, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + out_rows[:, None] * out_stride + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(out_rows[:, None] < M) & n_valid[None, :],
    )


#: K step of the tiled kernel: one scale group.
GEMM_BLOCK_K = GROUP_SIZE


def check_weight(weight: Tensor, k: int) -> int:
    """An e4m3 weight [N, k] with rows contiguous; returns N."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(
            f"the fp8 weight must be float8_e4m3fn [N, {k}], "
            f"not {weight.dtype} of shape {tuple(weight.shape)}"
        )
    if weight.stride(1) != 1:
        raise ValueError("the fp8 weight's rows must be contiguous (stride 1 along K)")
    return weight.shape[0]


def check_block_weight_scale(weight_scale: Tensor, n: int, k: int) -> None:
    expected = (triton.cdiv(n, GROUP_SIZE), triton.cdiv(k, GROUP_SIZE))
    if (
        weight_scale.dtype != torch.float32
        or tuple(weight_scale.shape) != expected
        or weight_scale.stride(1) != 1
    ):
        raise ValueError(
            f"block weight scales must be fp32 {list(expected)} (rows contiguous) for a weight "
            f"[{n}, {k}], not {weight_scale.dtype} of shape {tuple(weight_scale.shape)}"
        )


def check_bias(bias: Tensor | None, n: int) -> None:
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"the bias must be a contiguous [{n}], not {tuple(bias.shape)}")


def fp8_gemm(
    a: Tensor,
    weight: Tensor,
    a_scale: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig,
    block_scales: bool,
) -> Tensor:
    """a e4m3 [M, K] (rows contiguous), weight e4m3 [N, K] -> [M, N] in ``out_dtype``.

    ``block_scales``: a_scale fp32 [M, ceil(K/128)] (any strides: row-major, or the producers'
    tokens-contiguous layout), weight_scale fp32 [ceil(N/128), ceil(K/128)] (any row stride,
    elements contiguous within a row). Else per channel: a_scale [M] or [M, 1] per
    token, or one element for all; weight_scale [N] per channel, or one element."""
    if a.dtype != FP8_DTYPE or a.dim() != 2 or a.stride(1) != 1:
        raise ValueError(f"activations must be float8_e4m3fn [M, K] rows, not {a.dtype} {a.shape}")
    m, k = a.shape
    n = check_weight(weight, k)
    check_bias(bias, n)
    if block_scales:
        groups = triton.cdiv(k, GROUP_SIZE)
        if a_scale.dtype != torch.float32 or a_scale.shape != (m, groups):
            raise ValueError(
                f"activation scales must be fp32 [{m}, {groups}], "
                f"not {a_scale.dtype} of shape {tuple(a_scale.shape)}"
            )
        check_block_weight_scale(weight_scale, n, k)
        a_scale_stride, a_group_stride = a_scale.stride()
        w_scale_stride = weight_scale.stride(0)
    else:
        a_scale_stride, a_group_stride = per_channel_stride(a_scale, m, "activation"), 0
        w_scale_stride = per_channel_stride(weight_scale, n, "weight")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    fp8_gemm_kernel[grid](
        a, weight, a_scale, weight_scale, weight if bias is None else bias, out, m, n,
        a.stride(0), weight.stride(0), out.stride(0), a_scale_stride, a_group_stride,
        w_scale_stride, K=k,
        BLOCK_SCALES=block_scales, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=GEMM_BLOCK_K,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def per_channel_stride(scale: Tensor, count: int, what: str) -> int:
    """The stride between the scales of ``count`` rows or channels: 0 for one shared scale."""
    if scale.dtype != torch.float32:
        raise ValueError(f"{what} scales must be fp32, not {scale.dtype}")
    if scale.numel() == 1:
        return 0
    if scale.numel() != count or scale.dim() > 2 or (scale.dim() == 2 and 1 not in scale.shape):
        raise ValueError(
            f"{what} scales must hold one or {count} elements, not shape {tuple(scale.shape)}"
        )
    return scale.stride(0) if scale.shape[0] == count else scale.stride(-1)


def fp8_block_gemv(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, config: Fp8GemvConfig
) -> Tensor:
    """x [M, K] (unquantized, rows contiguous, M <= config.max_rows), weight e4m3 [N, K], block
    weight scales [ceil(N/128), ceil(K/128)] -> [M, N] in x's dtype: the activations quantized
    per token group of 128 (by ``per_token_group_quant_fp8`` where ``config.prequantize``, else
    by the same arithmetic inside the kernel)."""
    m, k = x.shape
    n = _check_gemv(m, k, weight, weight_scale, bias, config)
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    inputs, scales = per_token_group_quant_fp8(x) if config.prequantize else (x, weight_scale)
    return _launch_gemv(inputs, scales, weight, weight_scale, bias, x.dtype, config)


def fp8_block_gemv_quantized(
    q: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8GemvConfig,
) -> Tensor:
    """``fp8_block_gemv`` on activations already quantized per token group (e4m3 ``q`` [M, K],
    rows contiguous; fp32 ``scales`` [M, ceil(K/128)] in either order): the prequantized launch
    of ``config``'s tiling, whatever its ``prequantize``."""
    m, k = q.shape
    n = _check_gemv(m, k, weight, weight_scale, bias, config)
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=out_dtype, device=q.device)
    return _launch_gemv(
        q, scales, weight, weight_scale, bias, out_dtype, replace(config, prequantize=True)
    )


def _check_gemv(
    m: int, k: int, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, config: Fp8GemvConfig
) -> int:
    """The GEMV's operands checked (a clear error, not a fault); returns N."""
    if m > config.max_rows:
        raise ValueError(f"the fp8 GEMV takes at most {config.max_rows} rows, not {m}")
    n = check_weight(weight, k)
    check_block_weight_scale(weight_scale, n, k)
    check_bias(bias, n)
    return n


def _launch_gemv(
    inputs: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8GemvConfig,
) -> Tensor:
    (m, k), n = inputs.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=inputs.device)
    pdl = uses_pdl(inputs.device)
    fp8_block_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        inputs, scales, weight, weight_scale, weight if bias is None else bias, out, m, n,
        inputs.stride(0), scales.stride(0), scales.stride(1), weight.stride(0),
        weight_scale.stride(0),
        out.stride(0), K=k, HAS_BIAS=bias is not None, M_PAD=triton.next_power_of_2(m),
        BLOCK_N=config.block_n, GROUPS=config.groups, GROUP=GROUP_SIZE,
        PREQUANTIZED=config.prequantize, PDL=pdl, num_warps=config.num_warps,
        num_stages=config.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out


def fp8_block_matmul(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    config: Fp8GemmConfig | Fp8GemvConfig,
) -> Tensor:
    """x [M, K] (rows contiguous) -> [M, N] in x's dtype: the few-rows kernel for an
    ``Fp8GemvConfig``, else the activations quantized per token group, then the tiled kernel."""
    if isinstance(config, Fp8GemvConfig):
        return fp8_block_gemv(x, weight, weight_scale, bias, config)
    q, scales = per_token_group_quant_fp8(x)
    return fp8_gemm(q, weight, scales, weight_scale, bias, x.dtype, config, block_scales=True)
