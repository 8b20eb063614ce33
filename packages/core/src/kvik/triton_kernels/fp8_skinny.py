"""FP8 (e4m3) products of few rows (decode batches of 1 to 64 tokens) on the tensor cores:
``out [M, N] = dequant(x) @ dequant(w)^T (+ bias)``, with block scales (per token group of 128 and
128 x 128 weight blocks) or per-channel scales, the numerics of ``kvik.triton_kernels.fp8_gemm``.

At a few rows the time is the weight's bytes over the memory bandwidth, so the kernel is shaped
for streaming the weight, not for arithmetic:

- swapped operands: a program owns ``BLOCK_N`` weight rows, which fill the MMA's M side (64 rows
  a warpgroup), and the activations' rows, padded to 16, 32 or 64, are the MMA's N side; the
  weight goes from memory to shared memory as e4m3, never converted on the CUDA cores;
- one group of 128 input features a K step: each step's fp8 product is scaled by its block
  scales before it joins the fp32 sum, as the tiled kernel does;
- split-K where the layer's ``BLOCK_N``-row tiles are too few to fill the GPU: the splits of a
  tile write fp32 partial sums, and the last split to arrive (an atomic counter a tile) adds them
  in split order, so a product is one launch and its result does not depend on timing. The last
  split also puts its counter back to zero, so the counters are ready for the next launch without
  a memset (and a CUDA graph replays the launch as it is);
- the activations quantized per token group inside the kernel (``QUANTIZE``), so that a small
  product is one launch; each program redoes the quantization of its K range for all padded rows,
  which costs CUDA-core work in proportion to ``M_PAD / BLOCK_N`` a weight byte, so larger row
  counts take activations quantized by a launch of their own (``per_token_group_quant_fp8``).
  Per-channel products take activations quantized per token (their scale is the whole row's
  largest magnitude) by ``per_token_quant_fp8``.

Every constexpr is a layer's constant or comes from the padded row count (16, 32 or 64), so the
variants a model needs compile once, at warm-up, and the launches replay in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.fp8_gemm import (
    check_bias,
    check_block_weight_scale,
    check_weight,
    per_channel_stride,
)
from kvik.triton_kernels.fp8_quant import (
    ACTIVATION_DTYPES,
    FP8_DTYPE,
    GROUP_SIZE,
    dynamic_scale,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
    quantize_to_grid,
    scale_for_cast,
)
from kvik.triton_kernels.pdl import uses_pdl, wait_for_prior_kernel


@dataclass(frozen=True)
class Fp8SkinnyConfig:
    """A launch of the few-rows kernel: ``block_n`` weight rows a program (a multiple of 16 that
    divides 128 or is a multiple of it), K split ``split_k`` ways (each split a run of whole
    groups of 128), and for block scales whether the activations are quantized inside
    (``quantize``) or by a launch of their own first."""

    block_n: int
    split_k: int  # at most: the most ways up to it that divide the K groups evenly
    num_warps: int
    num_stages: int
    quantize: bool = True
    #: Groups of 128 features a pipeline stage loads, 1, 2 or 4 (activations quantized first):
    #: each weight row's bytes of a stage are one run of ``128 * groups_per_step``. The launch
    #: takes the most groups up to it that divide a split's groups in two steps or more.
    groups_per_step: int = 1
    #: With ``groups_per_step`` > 1: multiply a stage's whole tile once a group by the activations
    #: with the stage's other groups' features zeroed (``groups_per_step`` times the MMA work, the
    #: tile used as the copy left it in shared memory) rather than split it into the groups' tiles
    #: in registers first.
    masked_groups: bool = False

    def __post_init__(self) -> None:
        if (
            self.block_n < 16
            or self.block_n % 16
            or (GROUP_SIZE % self.block_n and self.block_n % GROUP_SIZE)
        ):
            raise ValueError(
                f"block_n must be a multiple of 16 that divides 128 or is a multiple of it, "
                f"not {self.block_n}"
            )
        if self.split_k < 1:
            raise ValueError(f"split_k must be at least 1, not {self.split_k}")
        if self.groups_per_step not in (1, 2, 4):
            raise ValueError(f"groups_per_step must be 1, 2 or 4, not {self.groups_per_step}")
        if self.groups_per_step > 1 and self.quantize:
            raise ValueError(
                "groups_per_step > 1 takes activations quantized first (quantize=False)"
            )
        if self.masked_groups and self.groups_per_step == 1:
            raise ValueError("masked_groups needs groups_per_step > 1")


#: The most rows the kernel takes: past them a product is no longer a weight read with a little
#: arithmetic beside it, and the tiled kernel or cuBLAS takes over.
SKINNY_MAX_ROWS = 64
#: The fewest padded rows: Triton's dot takes operands of 16 rows and more.
SKINNY_MIN_ROWS_PAD = 16


def padded_rows(m: int) -> int:
    """The MMA's N side for ``m`` rows: 16, 32 or 64 (a constexpr of the launch)."""
    return max(SKINNY_MIN_ROWS_PAD, triton.next_power_of_2(m))


@triton.jit
def _steps_of_groups(
    acc,
    w_ptr,
    w_stride,
    x_ptr,
    x_stride,
    x_ptrs,
    w_scale_ptr,
    x_scale_ptr,
    tile,
    n_load,
    rows,
    row_valid,
    within,
    g_first,
    x_scale_stride,
    x_scale_group_stride,
    w_scale_stride,
    K: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS_PER_SPLIT: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
    GROUP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """``fp8_skinny_kernel``'s K loop with ``GROUPS_PER_STEP`` (2 or 4) groups a pipeline stage
    (the activations quantized already). A stage's weight tile is one load, [BLOCK_N,
    GROUPS_PER_STEP * 128]: each row's bytes of the stage are one run of 256 or 512, where one group
    a stage asks each row for 128 bytes at a time. (On the H200 plain reads of a weight in runs
    of 128 bytes a row moved 3.07 TB/s, in runs of 512 bytes 3.84: docs/benchmarks.md, the
    fifty-third session.) The tile is split into its groups' [BLOCK_N, 128] tiles for the dots,
    each scaled by its own block scales and added in the same order as one group a step, so the
    sums are the same bits. ``MASKED`` instead multiplies the whole tile once a group by the
    stage's activations with the other groups' features zeroed: the zero products add nothing,
    so the sums are the same, for the MMA work of the whole tile a group and no split. A step's
    scales are loaded a step ahead, as there, [GROUPS_PER_STEP] at a time, and each group's
    picked out of them in registers."""
    js = tl.arange(0, GROUPS_PER_STEP)
    wide = tl.arange(0, GROUPS_PER_STEP * GROUP)
    w_rows = w_ptr + n_load[:, None].to(tl.int64) * w_stride + wide[None, :]  # [BLOCK_N, G * 128]
    x_rows = x_ptr + rows[:, None] * x_stride + wide[None, :]  # [M_PAD, G * 128]
    if BLOCK_SCALES:
        x_scale_row = x_scale_ptr + rows * x_scale_stride  # [M_PAD]
        if GROUP % BLOCK_N == 0:
            w_scale_row = w_scale_ptr + (tile * BLOCK_N // GROUP) * w_scale_stride
            w_scales_ahead = tl.load(w_scale_row + g_first + js)  # [G]
        else:
            w_scale_row = w_scale_ptr + (n_load // GROUP) * w_scale_stride  # [BLOCK_N]
            w_scales_ahead = tl.load(w_scale_row[:, None] + g_first + js[None, :])  # [BLOCK_N, G]
        x_scales_ahead = tl.load(
            x_scale_row[:, None] + (g_first + js[None, :]) * x_scale_group_stride,
            mask=row_valid[:, None],
            other=0.0,
        )  # [M_PAD, G]
    for i in range(0, GROUPS_PER_SPLIT // GROUPS_PER_STEP):
        g_step = g_first + i * GROUPS_PER_STEP
        if BLOCK_SCALES:
            w_scales = w_scales_ahead
            x_scales = x_scales_ahead
            g_ahead = (
                g_first
                + tl.minimum(i + 1, GROUPS_PER_SPLIT // GROUPS_PER_STEP - 1) * GROUPS_PER_STEP
            )
            if GROUP % BLOCK_N == 0:
                w_scales_ahead = tl.load(w_scale_row + g_ahead + js)
            else:
                w_scales_ahead = tl.load(w_scale_row[:, None] + g_ahead + js[None, :])
            x_scales_ahead = tl.load(
                x_scale_row[:, None] + (g_ahead + js[None, :]) * x_scale_group_stride,
                mask=row_valid[:, None],
                other=0.0,
            )
        k_step = g_step * GROUP
        if K % GROUP == 0:
            w_wide = tl.load(w_rows + k_step)
        else:
            w_wide = tl.load(w_rows + k_step, mask=(wide < K - k_step)[None, :], other=0.0)
        if not MASKED:
            # [BLOCK_N, G * 128] -> the groups' [BLOCK_N, 128] tiles (split halves a last
            # dimension of 2: group 2a + b of four is half b, then half a).
            w_groups = tl.permute(tl.reshape(w_wide, [BLOCK_N, GROUPS_PER_STEP, GROUP]), (0, 2, 1))
            if GROUPS_PER_STEP == 2:
                w0, w1 = tl.split(w_groups)
            else:
                even, odd = tl.split(tl.reshape(w_groups, [BLOCK_N, GROUP, 2, 2]))
                w0, w2 = tl.split(even)
                w1, w3 = tl.split(odd)
        for j in tl.static_range(GROUPS_PER_STEP):
            if MASKED:
                in_group = wide // GROUP == j
                if K % GROUP != 0:
                    in_group = in_group & (wide < K - k_step)
                x = tl.load(x_rows + k_step, mask=row_valid[:, None] & in_group[None, :], other=0.0)
                part = tl.dot(w_wide, tl.trans(x))  # [BLOCK_N, M_PAD], fp32
            else:
                k0 = (g_step + j) * GROUP
                if K % GROUP == 0:
                    x = tl.load(x_ptrs + k0, mask=row_valid[:, None], other=0.0)
                else:
                    k_valid = within < K - k0
                    x = tl.load(x_ptrs + k0, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
                if j == 0:
                    w = w0
                elif j == 1:
                    w = w1
                elif j == 2:
                    w = w2
                else:
                    w = w3
                part = tl.dot(w, tl.trans(x))  # [BLOCK_N, M_PAD], fp32
            if BLOCK_SCALES:
                x_scale = tl.sum(tl.where(js[None, :] == j, x_scales, 0.0), axis=1)  # [M_PAD]
                if GROUP % BLOCK_N == 0:
                    w_scale = tl.sum(tl.where(js == j, w_scales, 0.0), axis=0)
                    acc += part * (x_scale * w_scale)[None, :]
                else:
                    w_scale = tl.sum(tl.where(js[None, :] == j, w_scales, 0.0), axis=1)
                    acc += part * w_scale[:, None] * x_scale[None, :]
            else:
                acc += part
    return acc


@triton.jit
def fp8_skinny_kernel(
    x_ptr,  # [M, K], K contiguous: bf16/fp16/fp32 where QUANTIZE, else e4m3
    x_scale_ptr,  # block: [M, ceil(K/128)] (not QUANTIZE); per channel: [M] or one; else unused
    w_ptr,  # [N, K] e4m3, K contiguous
    w_scale_ptr,  # block: [ceil(N/128), ceil(K/128)]; per channel: [N] or one
    bias_ptr,  # [N] or unused
    out_ptr,  # [M, N]
    partial_ptr,  # [SPLIT_K, M, N] fp32 where SPLIT_K > 1, else unused
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero before the launch, where SPLIT_K > 1
    M,
    N,
    x_stride,
    x_scale_stride,  # between rows' scales (0: one scale for all)
    x_scale_group_stride,  # block: between a row's groups (1 row-major, M the producers' layout)
    w_stride,
    w_scale_stride,  # between weight-scale rows (block) or channels (0: one scale for all)
    out_stride,
    K: tl.constexpr,  # a layer's constant: the groups and whether K needs masks
    BLOCK_SCALES: tl.constexpr,
    QUANTIZE: tl.constexpr,  # block scales only: x unquantized, quantized per group here
    ROUND_IN_SOFTWARE: tl.constexpr,  # QUANTIZE: round_to_e4m3 (the interpreter), else the cast
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUPS_PER_SPLIT: tl.constexpr,
    GROUP: tl.constexpr,  # 128
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
    GROUPS_PER_STEP: tl.constexpr = 1,  # > 1: not QUANTIZE, divides GROUPS_PER_SPLIT
    MASKED_GROUPS: tl.constexpr = False,  # GROUPS_PER_STEP > 1: Fp8SkinnyConfig.masked_groups
):
    wait_for_prior_kernel(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    # Columns past the edge wrap to valid ones: their loads need no mask, their sums are dropped.
    n_load = n % N
    rows = tl.arange(0, M_PAD)
    row_valid = rows < M
    within = tl.arange(0, GROUP)
    w_ptrs = w_ptr + n_load[:, None].to(tl.int64) * w_stride + within[None, :]  # [BLOCK_N, GROUP]
    x_ptrs = x_ptr + rows[:, None] * x_stride + within[None, :]  # [M_PAD, GROUP]

    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    g_first = split * GROUPS_PER_SPLIT
    if GROUPS_PER_STEP > 1:
        acc = _steps_of_groups(
            acc, w_ptr, w_stride, x_ptr, x_stride, x_ptrs, w_scale_ptr, x_scale_ptr, tile, n_load,
            rows, row_valid, within, g_first, x_scale_stride, x_scale_group_stride,
            w_scale_stride, K, BLOCK_SCALES, BLOCK_N, GROUPS_PER_SPLIT, GROUPS_PER_STEP, GROUP,
            MASKED_GROUPS,
        )  # fmt: skip
    else:
        if BLOCK_SCALES:
            # A K step's scales are loaded one step ahead, carried in registers: loaded in the step
            # that uses them, they came after the MMA's wait and each step waited a whole memory
            # latency for them (the weight and activation tiles are pipelined by Triton, the scales
            # are not). The last step loads its own group's again, which is in bounds and unused.
            if GROUP % BLOCK_N == 0:
                # The tile lies in one weight-scale block: one scale for the tile a step.
                w_scale_row = w_scale_ptr + (tile * BLOCK_N // GROUP) * w_scale_stride
            else:
                w_scale_row = w_scale_ptr + (n_load // GROUP) * w_scale_stride
            w_scale_ahead = tl.load(w_scale_row + g_first)
            if not QUANTIZE:
                x_scale_row = x_scale_ptr + rows * x_scale_stride
                x_scale_ahead = tl.load(
                    x_scale_row + g_first * x_scale_group_stride, mask=row_valid, other=0.0
                )
        # The splits take equal runs of groups (split_k divides the groups): a constant trip count.
        for i in range(0, GROUPS_PER_SPLIT):
            g = g_first + i
            k0 = g * GROUP
            if BLOCK_SCALES:
                w_scale = w_scale_ahead
                g_ahead = g_first + tl.minimum(i + 1, GROUPS_PER_SPLIT - 1)
                w_scale_ahead = tl.load(w_scale_row + g_ahead)
                if not QUANTIZE:
                    x_scale = x_scale_ahead
                    x_scale_ahead = tl.load(
                        x_scale_row + g_ahead * x_scale_group_stride, mask=row_valid, other=0.0
                    )
            if K % GROUP == 0:
                w = tl.load(w_ptrs + k0)
                x = tl.load(x_ptrs + k0, mask=row_valid[:, None], other=0.0)
            else:
                k_valid = within < K - k0
                w = tl.load(w_ptrs + k0, mask=k_valid[None, :], other=0.0)
                x = tl.load(x_ptrs + k0, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            if QUANTIZE:
                xf = x.to(tl.float32)
                x_scale = dynamic_scale(tl.max(tl.abs(xf), axis=1))  # [M_PAD]
                # Every program redoes this for all padded rows, so on the GPU the compiled cast
                # rounds (the same values, fewer instructions on the CUDA cores a step).
                if ROUND_IN_SOFTWARE:
                    xq = quantize_to_grid(xf, x_scale[:, None]).to(w_ptr.dtype.element_ty)
                else:
                    xq = scale_for_cast(xf, x_scale[:, None]).to(w_ptr.dtype.element_ty)
            else:
                xq = x
            part = tl.dot(w, tl.trans(xq))  # [BLOCK_N, M_PAD], fp32
            if BLOCK_SCALES:
                if GROUP % BLOCK_N == 0:
                    acc += part * (x_scale * w_scale)[None, :]
                else:
                    acc += part * w_scale[:, None] * x_scale[None, :]
            else:
                acc += part
    if not BLOCK_SCALES:
        # Per-channel scales factor out of the sum: applied once, to this split's part.
        w_scale = tl.load(w_scale_ptr + n_load * w_scale_stride)
        x_scale = tl.load(x_scale_ptr + rows * x_scale_stride, mask=row_valid, other=0.0)
        acc = acc * w_scale[:, None] * x_scale[None, :]

    mask = n_valid[:, None] & row_valid[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_load).to(tl.float32)[:, None]
        out_ptrs = out_ptr + rows[None, :] * out_stride + n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # A split's sums [M, N]: M * N fits int32 (M <= 64); the split's offset is taken in int64
        # (SPLIT_K * M * N need not fit), and the reduction below steps a pointer instead.
        split_sums = M * N
        partial_ptrs = partial_ptr + rows[None, :] * N + n[:, None]  # [BLOCK_N, M_PAD]
        tl.store(partial_ptrs + split.to(tl.int64) * split_sums, acc, mask=mask)
        # Every thread's partial sums are written before one thread announces them (release),
        # and the last split reads the others' only after its atomic saw them all (acquire).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, M_PAD], tl.float32)
            for _ in range(0, SPLIT_K):  # not unrolled: one split's sums in registers at a time
                # Past L1 (".cg"): the other splits' sums were written by other multiprocessors.
                total += tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                partial_ptrs += split_sums
            if HAS_BIAS:
                total += tl.load(bias_ptr + n_load).to(tl.float32)[:, None]
            out_ptrs = out_ptr + rows[None, :] * out_stride + n[:, None]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch


#: Split-K counters a device holds: one a tile, so split products take layers of up to this many
#: ``block_n``-row tiles (the tuning splits only layers of few tiles).
SPLIT_COUNTERS = 4096
_counters: dict[torch.device, Tensor] = {}


def split_counters(device: torch.device) -> Tensor:
    """The device's split-K counters: zeros, allocated once and kept for the process (CUDA
    graphs hold their address), left zero by every launch. Launches on one stream only: two
    split products running at once on two streams would share them."""
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Allocated inside a capture, they would come from that graph's private pool and be
            # zeroed by a memset the graph replays: run a product eagerly before capturing (the
            # engine's and the bench's warm-up runs do).
            raise RuntimeError(
                "the fp8 few-rows kernel's split-K counters are allocated on a device's first "
                "split product, which must run outside CUDA graph capture (warm up first)"
            )
        counters = _counters[device] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return counters


def even_split(groups: int, most: int) -> int:
    """The most ways, at most ``most``, that ``groups`` split into equal runs."""
    return max(d for d in range(1, min(most, groups) + 1) if groups % d == 0)


def groups_a_step(config: Fp8SkinnyConfig, groups_per_split: int) -> int:
    """The groups a pipeline stage of ``config`` loads (``GROUPS_PER_STEP``) in splits of
    ``groups_per_split`` groups: the most, up to ``config.groups_per_step``, that divide them
    into two steps or more (a loop of one step is not pipelined: its loads would wait)."""
    per_step = 1
    while (
        per_step * 2 <= config.groups_per_step
        and groups_per_split % (per_step * 2) == 0
        and groups_per_split // (per_step * 2) >= 2
    ):
        per_step *= 2
    return per_step


def check_rows(x: Tensor) -> tuple[int, int]:
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"fp8 quantization takes bf16, fp16 or fp32 activations, not {x.dtype}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"activations must be [M, K] with contiguous rows, not {tuple(x.shape)}")
    m, k = x.shape
    if m > SKINNY_MAX_ROWS:
        raise ValueError(f"the fp8 few-rows kernel takes at most {SKINNY_MAX_ROWS} rows, not {m}")
    return m, k


def launch(
    x: Tensor,
    x_scale: Tensor,
    x_scale_stride: int,
    x_scale_group_stride: int,
    weight: Tensor,
    weight_scale: Tensor,
    w_scale_stride: int,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8SkinnyConfig,
    block_scales: bool,
    quantize: bool,
) -> Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    groups = triton.cdiv(k, GROUP_SIZE)
    split_k = even_split(groups, config.split_k)
    per_split = groups // split_k
    per_step = 1 if quantize else groups_a_step(config, per_split)
    tiles = triton.cdiv(n, config.block_n)
    if split_k > 1:
        if tiles > SPLIT_COUNTERS:
            raise ValueError(
                f"a split product takes at most {SPLIT_COUNTERS} tiles of {config.block_n} rows, "
                f"not {tiles}: use split_k=1 for a layer of {n} outputs"
            )
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    else:
        partial = counters = out
    pdl = uses_pdl(x.device)
    fp8_skinny_kernel[(tiles, split_k)](
        x, x_scale, weight, weight_scale, weight if bias is None else bias, out, partial,
        counters, m, n, x.stride(0), x_scale_stride, x_scale_group_stride, weight.stride(0),
        w_scale_stride,
        out.stride(0), K=k, BLOCK_SCALES=block_scales, QUANTIZE=quantize,
        ROUND_IN_SOFTWARE=not x.is_cuda,
        HAS_BIAS=bias is not None, M_PAD=padded_rows(m), BLOCK_N=config.block_n, SPLIT_K=split_k,
        GROUPS_PER_SPLIT=per_split, GROUP=GROUP_SIZE, PDL=pdl, GROUPS_PER_STEP=per_step,
        MASKED_GROUPS=per_step > 1 and config.masked_groups,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out


def fp8_skinny_block_matmul(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, config: Fp8SkinnyConfig
) -> Tensor:
    """x [M, K] (unquantized, rows contiguous, M <= 64), weight e4m3 [N, K], block weight scales
    fp32 [ceil(N/128), ceil(K/128)] -> [M, N] in x's dtype; the activations quantized per token
    group of 128, inside the kernel where ``config.quantize``, else by a launch of their own."""
    m, k = check_rows(x)
    n = check_weight(weight, k)
    check_block_weight_scale(weight_scale, n, k)
    check_bias(bias, n)
    if config.quantize:
        inputs, scales = x, weight_scale  # scales unused
    else:
        inputs, scales = per_token_group_quant_fp8(x)
    return launch(
        inputs, scales, scales.stride(0), scales.stride(1), weight, weight_scale,
        weight_scale.stride(0), bias, x.dtype, config, block_scales=True,
        quantize=config.quantize,
    )  # fmt: skip


def fp8_skinny_block_matmul_quantized(
    q: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8SkinnyConfig,
) -> Tensor:
    """``fp8_skinny_block_matmul`` on activations already quantized per token group (e4m3 ``q``
    [M, K], rows contiguous; fp32 ``scales`` [M, ceil(K/128)] in either order): ``config``'s
    tiling with the activations read as they are, whatever its ``quantize``."""
    if q.dtype != FP8_DTYPE or q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(f"activations must be float8_e4m3fn [M, K] rows, not {q.dtype} {q.shape}")
    m, k = q.shape
    if m > SKINNY_MAX_ROWS:
        raise ValueError(f"the fp8 few-rows kernel takes at most {SKINNY_MAX_ROWS} rows, not {m}")
    n = check_weight(weight, k)
    check_block_weight_scale(weight_scale, n, k)
    check_bias(bias, n)
    return launch(
        q, scales, scales.stride(0), scales.stride(1), weight, weight_scale,
        weight_scale.stride(0), bias, out_dtype, config, block_scales=True, quantize=False,
    )  # fmt: skip


def fp8_skinny_scaled_matmul(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    config: Fp8SkinnyConfig,
) -> Tensor:
    """x [M, K] (unquantized, rows contiguous, M <= 64), weight e4m3 [N, K], weight scales fp32
    [1] or [N], a static activation scale fp32 [1] or None (dynamic per token) -> [M, N] in x's
    dtype; the activations quantized by ``per_token_quant_fp8`` first."""
    m, k = check_rows(x)
    n = check_weight(weight, k)
    check_bias(bias, n)
    w_scale_stride = per_channel_stride(weight_scale, n, "weight")
    q, a_scale = per_token_quant_fp8(x, input_scale)
    a_scale_stride = per_channel_stride(a_scale, m, "activation")
    return launch(
        q, a_scale, a_scale_stride, 0, weight, weight_scale, w_scale_stride, bias, x.dtype,
        config, block_scales=False, quantize=False,
    )  # fmt: skip
