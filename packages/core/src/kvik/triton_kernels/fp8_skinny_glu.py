"""A block-FP8 gate/up product of few rows that ends in SiLU-and-mul and writes down's quantized
input: ``q, s = quant(silu(x @ w_gate^T) * (x @ w_up^T))``, one launch where a decode step ran
two (the few-rows product, then ``silu_and_mul_fp8_group_quant``).

At batch 1 a Llama-3.1-8B step's SiLU-and-mul launches are 32 of its ~290 kernels, each a few
microseconds of launch, wait and drain around a few kilobytes of work. A program of the few-rows
kernel (``kvik.triton_kernels.fp8_skinny``) already owns whole output features; here it owns 128
gate features and the 128 up features that pair with them, so its last step can apply the
activation and quantize the 128 results of each row as one group of down's input.

The numbers are those of the few-rows product with the same 128-row tiles and K splits followed
by SiLU-and-mul's quantizing launch, bit for bit: the same K steps and split-K order, the gate and
up sums rounded to the activations' dtype (as the product's output was), ``silu(g) * u`` in fp32
rounded to that dtype again (as SiLU-and-mul wrote it), then quantized per group of 128 as
``per_token_group_quant_fp8`` does. Against the two launches the engine would run otherwise
(the tuning's tiles for the product, often fewer K splits) they differ only by the order of the
fp32 sums of the K splits.

Takes activations already quantized per token group (the norm before gate/up writes them so:
kvik.quantization.activation) and intermediate sizes that are multiples of 128 (a program's
group of down's input must not straddle two programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.fp8_gemm import check_bias, check_block_weight_scale, check_weight
from kvik.triton_kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP_SIZE,
    dynamic_scale,
    empty_group_scales,
    quantize_for_cast,
    rounds_in_software,
)
from kvik.triton_kernels.fp8_skinny import (
    SKINNY_MAX_ROWS,
    SPLIT_COUNTERS,
    Fp8SkinnyConfig,
    even_split,
    padded_rows,
    split_counters,
)
from kvik.triton_kernels.pdl import uses_pdl, wait_for_prior_kernel

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _silu_mul_quantized_store(
    gate, up, bias_ptr, n, inter, rows, M, out_ptr, out_scale_ptr, tile,
    HAS_BIAS: tl.constexpr, ACT_DTYPE: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr,
):  # fmt: skip
    """A tile's sums (fp32 [128, M_PAD], features by rows) to down's quantized input: bias,
    rounding to the activations' dtype, silu(gate) * up, rounding again, then each row's 128
    results quantized as one group."""
    if HAS_BIAS:
        gate += tl.load(bias_ptr + n).to(tl.float32)[:, None]
        up += tl.load(bias_ptr + inter + n).to(tl.float32)[:, None]
    gate = gate.to(ACT_DTYPE).to(tl.float32)
    up = up.to(ACT_DTYPE).to(tl.float32)
    y = (gate * tl.sigmoid(gate) * up).to(ACT_DTYPE).to(tl.float32)  # [128, M_PAD]
    scale = dynamic_scale(tl.max(tl.abs(y), axis=0))  # [M_PAD]
    q = quantize_for_cast(y, scale[None, :], ROUND_IN_SOFTWARE)
    row_valid = rows < M
    out_ptrs = out_ptr + rows[None, :] * inter + n[:, None]
    tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=row_valid[None, :])
    # The scales tokens-contiguous (empty_group_scales): group ``tile`` of row r at tile * M + r.
    tl.store(out_scale_ptr + tile * M + rows, scale, mask=row_valid)


@triton.jit
def fp8_skinny_glu_kernel(
    x_ptr,  # [M, K] e4m3, K contiguous
    x_scale_ptr,  # [M, ceil(K/128)] fp32, either order
    w_ptr,  # [2 * I, K] e4m3: gate's rows, then up's
    w_scale_ptr,  # [2 * I / 128, ceil(K/128)] fp32
    bias_ptr,  # [2 * I] or unused
    out_ptr,  # [M, I] e4m3
    out_scale_ptr,  # [M, I / 128] fp32, tokens contiguous
    partial_ptr,  # [SPLIT_K, 2, M, I] fp32 where SPLIT_K > 1, else unused
    counter_ptr,  # [>= I / 128] int32, zero before the launch, where SPLIT_K > 1
    M,
    inter,  # I, a multiple of 128
    x_stride,
    x_scale_stride,
    x_scale_group_stride,
    w_stride,
    w_scale_stride,
    K: tl.constexpr,
    ACT_DTYPE: tl.constexpr,  # the activations' dtype: gate/up and their product round to it
    ROUND_IN_SOFTWARE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUPS_PER_SPLIT: tl.constexpr,
    GROUP: tl.constexpr,  # 128: a tile's features, a weight-scale block, a quantization group
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n = tile * GROUP + tl.arange(0, GROUP)  # gate's rows; up's are inter further
    rows = tl.arange(0, M_PAD)
    row_valid = rows < M
    within = tl.arange(0, GROUP)
    gate_ptrs = w_ptr + n[:, None].to(tl.int64) * w_stride + within[None, :]  # [GROUP, GROUP]
    up_ptrs = gate_ptrs + inter.to(tl.int64) * w_stride
    x_ptrs = x_ptr + rows[:, None] * x_stride + within[None, :]  # [M_PAD, GROUP]

    acc_gate = tl.zeros([GROUP, M_PAD], tl.float32)
    acc_up = tl.zeros([GROUP, M_PAD], tl.float32)
    g_first = split * GROUPS_PER_SPLIT
    # As in fp8_skinny_kernel: a K step's scales are loaded one step ahead.
    gate_scale_row = w_scale_ptr + tile * w_scale_stride
    up_scale_row = gate_scale_row + (inter // GROUP) * w_scale_stride
    x_scale_row = x_scale_ptr + rows * x_scale_stride
    gate_scale_ahead = tl.load(gate_scale_row + g_first)
    up_scale_ahead = tl.load(up_scale_row + g_first)
    x_scale_ahead = tl.load(x_scale_row + g_first * x_scale_group_stride, mask=row_valid, other=0.0)
    for i in range(0, GROUPS_PER_SPLIT):
        k0 = (g_first + i) * GROUP
        gate_scale = gate_scale_ahead
        up_scale = up_scale_ahead
        x_scale = x_scale_ahead
        g_ahead = g_first + tl.minimum(i + 1, GROUPS_PER_SPLIT - 1)
        gate_scale_ahead = tl.load(gate_scale_row + g_ahead)
        up_scale_ahead = tl.load(up_scale_row + g_ahead)
        x_scale_ahead = tl.load(
            x_scale_row + g_ahead * x_scale_group_stride, mask=row_valid, other=0.0
        )
        if K % GROUP == 0:
            w_gate = tl.load(gate_ptrs + k0)
            w_up = tl.load(up_ptrs + k0)
            x = tl.load(x_ptrs + k0, mask=row_valid[:, None], other=0.0)
        else:
            k_valid = within < K - k0
            w_gate = tl.load(gate_ptrs + k0, mask=k_valid[None, :], other=0.0)
            w_up = tl.load(up_ptrs + k0, mask=k_valid[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        xt = tl.trans(x)
        acc_gate += tl.dot(w_gate, xt) * (x_scale * gate_scale)[None, :]
        acc_up += tl.dot(w_up, xt) * (x_scale * up_scale)[None, :]

    if SPLIT_K == 1:
        _silu_mul_quantized_store(
            acc_gate, acc_up, bias_ptr, n, inter, rows, M, out_ptr, out_scale_ptr, tile,
            HAS_BIAS, ACT_DTYPE, ROUND_IN_SOFTWARE,
        )  # fmt: skip
    else:
        # fp8_skinny_kernel's split-K: partial sums, the last split to arrive adds them in split
        # order (the same order as there, so the same sums) and puts the counter back to zero.
        split_sums = M * inter
        mask = row_valid[None, :]
        gate_partials = partial_ptr + rows[None, :] * inter + n[:, None]  # [GROUP, M_PAD]
        split_base = split.to(tl.int64) * 2 * split_sums
        tl.store(gate_partials + split_base, acc_gate, mask=mask)
        tl.store(gate_partials + split_base + split_sums, acc_up, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            gate = tl.zeros([GROUP, M_PAD], tl.float32)
            up = tl.zeros([GROUP, M_PAD], tl.float32)
            for _ in range(0, SPLIT_K):
                gate += tl.load(gate_partials, mask=mask, other=0.0, cache_modifier=".cg")
                up += tl.load(
                    gate_partials + split_sums, mask=mask, other=0.0, cache_modifier=".cg"
                )
                gate_partials += 2 * split_sums
            _silu_mul_quantized_store(
                gate, up, bias_ptr, n, inter, rows, M, out_ptr, out_scale_ptr, tile,
                HAS_BIAS, ACT_DTYPE, ROUND_IN_SOFTWARE,
            )  # fmt: skip
            tl.atomic_xchg(counter_ptr + tile, 0)


def fuses_silu_and_mul(inter: int, m: int) -> bool:
    """Whether ``fp8_skinny_glu_block_matmul`` takes a gate/up product of ``m`` rows and
    intermediate size ``inter``."""
    return 0 < m <= SKINNY_MAX_ROWS and inter > 0 and inter % GROUP_SIZE == 0


#: The most rows the engine fuses (kvik_cuda): with two [128, rows] fp32 sums a program, 32 and
#: 64 padded rows take all 255 registers of 4 warps (64 spills; ptxas for sm_90a), where 16 take
#: 140; those sizes keep the two launches until they are measured.
GLU_ENGINE_MAX_ROWS = 16


def glu_config(config: Fp8SkinnyConfig, k: int) -> Fp8SkinnyConfig:
    """The fused launch for a gate/up product the few-rows kernel would run as ``config``: as
    many programs, each streaming as many weight bytes. A fused program owns 256 weight rows (128
    of gate, 128 of up), so it splits K ``256 / block_n`` times more ways; its pipeline stage
    holds two weight tiles, so it takes about half the stages (the same bytes in flight, and the
    same programs fit on a multiprocessor)."""
    groups = triton.cdiv(k, GROUP_SIZE)
    split_k = even_split(groups, config.split_k * max(1, 2 * GROUP_SIZE // config.block_n))
    return Fp8SkinnyConfig(
        block_n=GROUP_SIZE,
        split_k=split_k,
        num_warps=config.num_warps,
        num_stages=max(2, (config.num_stages + 1) // 2),
        quantize=False,
    )


def fp8_skinny_glu_block_matmul(
    q: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    act_dtype: torch.dtype,
    config: Fp8SkinnyConfig,
) -> tuple[Tensor, Tensor]:
    """Activations quantized per token group (e4m3 ``q`` [M, K], rows contiguous, M <= 64; fp32
    ``scales`` [M, ceil(K/128)] in either order), a gate/up weight e4m3 [2I, K] (gate's rows
    first) with block scales [2I/128, ceil(K/128)] and an optional bias [2I] -> down's input
    quantized per token group: (e4m3 [M, I], fp32 scales [M, I/128] tokens contiguous), the
    values ``silu_and_mul_fp8_group_quant`` gives for the product's output in ``act_dtype``.
    ``config``: the 128-row launch (``glu_config``)."""
    if q.dtype != FP8_DTYPE or q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(f"activations must be float8_e4m3fn [M, K] rows, not {q.dtype} {q.shape}")
    m, k = q.shape
    n = check_weight(weight, k)
    check_block_weight_scale(weight_scale, n, k)
    check_bias(bias, n)
    inter = n // 2
    if n % 2 or not fuses_silu_and_mul(inter, m):
        raise ValueError(
            f"the fused gate/up product takes 1 to {SKINNY_MAX_ROWS} rows and a weight of 2 x I "
            f"rows, I a multiple of {GROUP_SIZE}; not {m} rows and {n} weight rows"
        )
    if act_dtype not in _TL_DTYPES:
        raise ValueError(f"activations are bf16, fp16 or fp32, not {act_dtype}")
    if config.block_n != GROUP_SIZE:
        raise ValueError(
            f"the fused gate/up product's tiles are {GROUP_SIZE} rows, not {config.block_n}"
        )
    out = torch.empty(m, inter, dtype=FP8_DTYPE, device=q.device)
    out_scales = empty_group_scales(m, inter // GROUP_SIZE, q.device)
    groups = triton.cdiv(k, GROUP_SIZE)
    if k == 0:
        raise ValueError("the fused gate/up product needs K > 0")
    split_k = even_split(groups, config.split_k)
    tiles = inter // GROUP_SIZE
    if split_k > 1:
        if tiles > SPLIT_COUNTERS:
            raise ValueError(f"a split product takes at most {SPLIT_COUNTERS} tiles, not {tiles}")
        partial = torch.empty(split_k, 2, m, inter, dtype=torch.float32, device=q.device)
        counters = split_counters(q.device)
    else:
        partial = counters = out
    pdl = uses_pdl(q.device)
    fp8_skinny_glu_kernel[(tiles, split_k)](
        q, scales, weight, weight_scale, weight if bias is None else bias, out, out_scales,
        partial, counters, m, inter, q.stride(0), scales.stride(0), scales.stride(1),
        weight.stride(0), weight_scale.stride(0), K=k, ACT_DTYPE=_TL_DTYPES[act_dtype],
        ROUND_IN_SOFTWARE=rounds_in_software(q.device), HAS_BIAS=bias is not None,
        M_PAD=padded_rows(m), SPLIT_K=split_k, GROUPS_PER_SPLIT=groups // split_k,
        GROUP=GROUP_SIZE, PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages,
        launch_pdl=pdl,
    )  # fmt: skip
    return out, out_scales
