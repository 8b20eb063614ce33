"""The fused MoE's down GEMM for prefill-sized steps: persistent programs that load both operands
with TMA (tensor descriptors). Part of ``kvik.triton_kernels.fused_moe``, which decides when it
runs (a configuration's ``tma``); reference: ``kvik.ops.fused_moe``.

Why a second form of the down GEMM. At Qwen3-30B-A3B's 4096-token step a stand-alone probe of
this GEMM took 242.5 µs on an H100 where ``moe_gemm_kernel`` took 274.3 (docs/benchmarks.md,
the forty-sixth session): a program per SM looping over the tiles overlaps one tile's epilogue
with the next tile's loads, and TMA moves each K step's tiles without the address arithmetic of
pointer loads. Neither alone gained. Hopper's TMA cannot gather rows, so the activations must be
contiguous per row block: the gate/up GEMM stores its output in the aligned (sorted) order
(``moe_gemm_kernel``'s OUT_BY_SLOT), row block b's rows at [b * BLOCK_M, (b + 1) * BLOCK_M), the
padding rows unwritten. Each output row depends on its own input row alone, so whatever the
padding rows hold reaches only padding outputs, which are never stored.

The gate/up GEMM has a persistent form too (``moe_gate_up_tma_kernel``, where the gate/up
configuration asks): its activations are gathered by token, which TMA cannot do on Hopper, so
they stay pointer loads, while the experts' gate and up tiles come by TMA. The same probe gave
that GEMM -4% (428.4 against 444.8 µs at 4096 tokens on an H100), but in the whole op it lost at
every shape measured (bf16 and block FP8, 2048-8192 tokens, on an H100: docs/benchmarks.md, the
fifty-second session), so no table row asks for it; the tuner still tries it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.fused_moe import _step_product, scale_args


@triton.jit
def _tile_coordinates(tile, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """Tile ``tile``'s (row block, column block): GROUP_M row blocks sweep the columns together
    (as in ``moe_gemm_kernel``). Any tile index at all maps into the grid, the ones past the
    last included, because the loop over the tiles is flattened and Triton's nested-loop fusion
    may evaluate a tile's index arithmetic and scalar loads ahead of the trip that guards them
    (triton-lang/triton#11601): past the last tile the last group can be empty (a division by
    zero) and the column block past N, and the block-FP8 scale loads are pointer loads, not
    bounds-checked as TMA's are. Clamping changes no tile the loop runs. (It did not cure the
    block-FP8 form's illegal memory access at 8192 tokens: docs/benchmarks.md, the forty-ninth
    session.)"""
    per_group = GROUP_M * blocks_n
    first_m = (tile // per_group) * GROUP_M
    group_size = tl.maximum(tl.minimum(blocks_m - first_m, GROUP_M), 1)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    pid_m = tl.maximum(tl.minimum(pid_m, blocks_m - 1), 0)
    pid_n = tl.maximum(tl.minimum(pid_n, blocks_n - 1), 0)
    return pid_m, pid_n


@triton.jit
def moe_down_tma_kernel(
    a_desc,  # [row blocks * BLOCK_M, K]: the activations in the aligned order
    w_desc,  # [E * N, K]: the experts' weights, one expert's N rows after another's
    out_ptr,  # [num_pairs, N], stored per pair
    sorted_ptr,  # the aligned pairs (align_to_blocks), num_pairs where padding
    block_expert_ptr,
    total_ptr,  # the aligned rows in use (a multiple of BLOCK_M)
    weights_ptr,  # WEIGHTED: the pairs' routing weights
    a_scale_ptr,  # FP8_BLOCK: [row blocks * BLOCK_M, ceil(K/128)] fp32, by aligned row
    w_scale_ptr,  # FP8_BLOCK: [E, ceil(N/128), ceil(K/128)] fp32
    num_pairs,
    num_programs,
    N,
    K,
    stride_om,
    stride_asm,
    stride_wse,
    stride_wsn,
    WEIGHTED: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[pair, :N] = A[slot] @ W[expert]^T (times the pair's weight) for every aligned slot
    holding a pair; BLOCK_N divides N (the launcher checks), K's last step is zero-filled by the
    descriptors. The programs take the tiles of the rows in use in turn, GROUP_M row blocks
    sweeping the columns together as in ``moe_gemm_kernel``."""
    blocks_n = N // BLOCK_N
    blocks_m = tl.cdiv(tl.load(total_ptr), BLOCK_M)
    tiles = blocks_m * blocks_n
    for tile in tl.range(tl.program_id(0), tiles, num_programs, flatten=True):
        pid_m, pid_n = _tile_coordinates(tile, blocks_m, blocks_n, GROUP_M)
        # -1 marks row blocks past the rows in use: only a tile computed ahead of time meets one.
        expert = tl.maximum(tl.load(block_expert_ptr + pid_m), 0)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            w = w_desc.load([expert * N + pid_n * BLOCK_N, k * BLOCK_K])
            if FP8_BLOCK:
                # BLOCK_K divides 128: the step lies in one scale group.
                group = k * BLOCK_K // 128
                a_scale = tl.load(a_scale_ptr + rows.to(tl.int64) * stride_asm + group)
                w_scale = tl.load(
                    w_scale_ptr + expert.to(tl.int64) * stride_wse + (cols // 128) * stride_wsn
                    + group
                )  # fmt: skip
                acc += tl.dot(a, w.T) * a_scale[:, None] * w_scale[None, :]
            else:
                acc = tl.dot(a, w.T, acc, input_precision="ieee")  # fp32 without TF32
        pair = tl.load(sorted_ptr + rows)
        row_ok = pair < num_pairs
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _gate_up_tile(
    a_ptr,
    w_desc,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    expert,
    pair,
    slots,
    pid_n,
    num_pairs,
    N,
    K,
    stride_am,
    stride_om,
    stride_asm,
    stride_wse,
    stride_wsn,
    A_ROW_DIV: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    OUT_BY_SLOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M pairs, BLOCK_N columns] tile of ``moe_gate_up_tma_kernel``: the pairs' rows
    of A by pointer loads (padding slots read row 0 and are never stored), the expert's gate
    and up tiles by TMA, ``silu(gate) * up`` stored at the pairs (or OUT_BY_SLOT their slots)."""
    row_ok = pair < num_pairs
    a_row = tl.where(row_ok, pair // A_ROW_DIV, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_row = expert * 2 * N + pid_n * BLOCK_N
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = (ks < K - k * BLOCK_K) | EVEN_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w_gate = w_desc.load([gate_row, k * BLOCK_K])
        w_up = w_desc.load([gate_row + N, k * BLOCK_K])
        if FP8_BLOCK:
            # BLOCK_K divides 128: the step lies in one scale group.
            group = k * BLOCK_K // 128
            a_scale = tl.load(a_scale_ptr + a_row * stride_asm + group)
            w_scales = w_scale_ptr + expert.to(tl.int64) * stride_wse + group
            gate_scale = tl.load(w_scales + (cols // 128) * stride_wsn)
            up_scale = tl.load(w_scales + ((N + cols) // 128) * stride_wsn)
        else:
            a_scale, gate_scale, up_scale = 0.0, 0.0, 0.0  # not read
        acc_gate = _step_product(a, w_gate.T, acc_gate, a_scale, gate_scale, FP8_BLOCK, False)
        acc_up = _step_product(a, w_up.T, acc_up, a_scale, up_scale, FP8_BLOCK, False)
        a_ptrs += BLOCK_K
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_row = slots if OUT_BY_SLOT else pair
    out_ptrs = out_ptr + out_row.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def moe_gate_up_tma_kernel(
    a_ptr,  # [tokens, K]: the activations, pair p reads row p // A_ROW_DIV
    w_desc,  # [E * 2N, K]: each expert's N gate rows, then its N up rows
    out_ptr,  # [num_pairs, N] per pair, or OUT_BY_SLOT [row blocks * BLOCK_M, N] per slot
    sorted_ptr,  # the aligned pairs (align_to_blocks), num_pairs where padding
    block_expert_ptr,
    total_ptr,  # the aligned rows in use (a multiple of BLOCK_M)
    a_scale_ptr,  # FP8_BLOCK: [tokens, ceil(K/128)] fp32
    w_scale_ptr,  # FP8_BLOCK: [E, ceil(2N/128), ceil(K/128)] fp32
    num_pairs,
    num_programs,
    N,
    K,
    stride_am,
    stride_om,
    stride_asm,
    stride_wse,
    stride_wsn,
    A_ROW_DIV: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    OUT_BY_SLOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HALF_ROWS: tl.constexpr,
):
    """out[pair, :N] = silu(A[pair // A_ROW_DIV] @ gate^T) * (A[...] @ up^T) of the pair's
    expert, for every aligned slot holding a pair (``moe_gemm_kernel``'s GATED product, without
    its SWAP_AB and PAIRED forms). BLOCK_N divides N (the launcher checks), so a weight tile lies
    in one expert's gate (or up) rows; K's last step is zero-filled by the descriptor and masked
    in A's loads. HALF_ROWS as in ``moe_gemm_kernel``: a row block whose middle slot is padding
    multiplies its first half alone. The loop over the tiles is flattened (Triton's nested-loop
    fusion, which overlaps a tile's epilogue with the next one's loads) only without HALF_ROWS,
    whose two inner loops under a branch it cannot fuse."""
    blocks_n = N // BLOCK_N
    blocks_m = tl.cdiv(tl.load(total_ptr), BLOCK_M)
    tiles = blocks_m * blocks_n
    for tile in tl.range(tl.program_id(0), tiles, num_programs, flatten=not HALF_ROWS):
        pid_m, pid_n = _tile_coordinates(tile, blocks_m, blocks_n, GROUP_M)
        # -1 marks row blocks past the rows in use: only a tile computed ahead of time meets one.
        expert = tl.maximum(tl.load(block_expert_ptr + pid_m), 0)
        first = pid_m * BLOCK_M
        # A run's pairs fill its first slots, so a block whose middle slot is padding has pairs
        # in its first half only.
        half = False
        if HALF_ROWS:
            half = tl.load(sorted_ptr + first + BLOCK_M // 2) >= num_pairs
        if half:
            # (Names of their own in each branch: Triton refuses a variable of two shapes.)
            half_slots = first + tl.arange(0, BLOCK_M // 2)
            _gate_up_tile(
                a_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, expert,
                tl.load(sorted_ptr + half_slots), half_slots, pid_n, num_pairs, N, K, stride_am,
                stride_om, stride_asm, stride_wse, stride_wsn, A_ROW_DIV, FP8_BLOCK,
                OUT_BY_SLOT, EVEN_K, BLOCK_M // 2, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        else:
            slots = first + tl.arange(0, BLOCK_M)
            _gate_up_tile(
                a_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, expert,
                tl.load(sorted_ptr + slots), slots, pid_n, num_pairs, N, K, stride_am,
                stride_om, stride_asm, stride_wse, stride_wsn, A_ROW_DIV, FP8_BLOCK,
                OUT_BY_SLOT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip


#: (kernel, configuration, operand dtype) -> the pipeline depth that fits the device's shared
#: memory, once a launch has found it (see ``_launch_within_shared_memory``).
_FITTING_STAGES: dict[tuple, int] = {}


def _launch_within_shared_memory(kernel, grid, key: tuple, stages: int, *args, **kwargs) -> None:
    """Launch ``kernel`` at ``stages`` pipeline stages, or at the deepest pipeline below it whose
    buffers fit in shared memory. A configuration tuned for the pointer-load GEMM (which
    ``KVIK_MOE_TMA_UP=1`` or ``KVIK_MOE_TMA=1`` force into these kernels) can need more shared
    memory here, and Triton knows the exact need only once it has compiled the kernel; it raises
    before anything runs, so retrying one stage shallower is safe, and the depth found is kept."""
    from triton.runtime.errors import OutOfResources

    known = _FITTING_STAGES.get(key)
    for depth in range(known or stages, 0, -1):
        try:
            kernel[grid](*args, num_stages=depth, **kwargs)
        except OutOfResources:
            if depth == 1:
                raise
            continue
        _FITTING_STAGES[key] = depth
        return


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each looping over several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_supported(device: torch.device) -> bool:
    """Whether ``moe_down_tma`` may run here: on NVIDIA GPUs from Hopper (sm_90, TMA), or on the
    CPU under the interpreter."""
    if device.type == "cpu":
        return True
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and (torch.cuda.get_device_capability(device)[0] >= 9)
    )


def down_tma_fits(n: int, k: int, itemsize: int, config) -> bool:
    """Whether the down GEMM suits ``moe_down_tma_kernel``: BLOCK_N divides the experts' N (one
    expert's rows a weight tile), and a row of K elements is a multiple of 16 bytes (a tensor
    descriptor's strides must be)."""
    return n % config.block_n == 0 and (k * itemsize) % 16 == 0


def moe_down_tma(
    act_sorted: Tensor,
    w: Tensor,
    out: Tensor,
    aligned: tuple[Tensor, Tensor, Tensor],
    weights: Tensor | None,
    config,
    scales: tuple[Tensor, Tensor] | None = None,
) -> None:
    """``out[pair] = act_sorted[slot of pair] @ w[expert]^T`` (times ``weights[pair]``) for the
    pairs ``aligned`` by ``align_to_blocks`` at ``config.block_m`` rows a block; ``act_sorted``
    [row blocks * block_m, K] holds the gate/up GEMM's output in that order. ``scales``: the
    activations' per-row-group scales (same order) and the weights' tile scales (block FP8)."""
    sorted_pairs, block_expert, total = aligned
    experts, n, k = w.shape
    if not down_tma_fits(n, k, w.element_size(), config):
        raise ValueError(
            f"moe_down_tma needs block_n to divide N={n} and rows of K={k} in multiples of 16 "
            f"bytes, got {config} and {w.dtype}"
        )
    if act_sorted.shape[0] != block_expert.shape[0] * config.block_m:
        raise ValueError(
            f"act_sorted has {act_sorted.shape[0]} rows for {block_expert.shape[0]} row blocks "
            f"of {config.block_m}"
        )
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_desc = TensorDescriptor.from_tensor(act_sorted, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(w.view(experts * n, k), [config.block_n, config.block_k])
    a_scale, w_scale, scale_strides = scale_args(scales, out)
    tiles = block_expert.shape[0] * (n // config.block_n)
    programs = max(1, min(_multiprocessors(out.device), tiles))
    _launch_within_shared_memory(
        moe_down_tma_kernel, (programs,), ("down", config, w.dtype), config.num_stages,
        a_desc, w_desc, out, sorted_pairs, block_expert, total,
        out if weights is None else weights, a_scale, w_scale,
        out.shape[0], programs, n, k, out.stride(0), *scale_strides,
        WEIGHTED=weights is not None, FP8_BLOCK=scales is not None, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps,
    )  # fmt: skip


def gate_up_tma_fits(n: int, k: int, itemsize: int, config) -> bool:
    """Whether the gate/up GEMM (N = the experts' intermediate size) suits
    ``moe_gate_up_tma_kernel``: BLOCK_N divides N and a row of K is a multiple of 16 bytes."""
    return n % config.block_n == 0 and (k * itemsize) % 16 == 0


def moe_gate_up_tma(
    a: Tensor,
    w13: Tensor,
    out: Tensor,
    aligned: tuple[Tensor, Tensor, Tensor],
    a_row_div: int,
    config,
    scales: tuple[Tensor, Tensor] | None = None,
    out_by_slot: bool = False,
) -> None:
    """``out[pair] = silu(a[pair // a_row_div] @ gate[expert]^T) * (... @ up[expert]^T)`` for
    the pairs ``aligned`` by ``align_to_blocks`` at ``config.block_m`` rows a block, w13 [E, 2N,
    K] (gate rows, then up rows). ``out_by_slot``: out [row blocks * block_m, N] takes each row
    at its aligned slot (for ``moe_down_tma``). ``scales``: A's per-row-group scales and W's tile
    scales (block FP8)."""
    sorted_pairs, block_expert, total = aligned
    experts, two_n, k = w13.shape
    n = two_n // 2
    if not gate_up_tma_fits(n, k, w13.element_size(), config):
        raise ValueError(
            f"moe_gate_up_tma needs block_n to divide N={n} and rows of K={k} in multiples of "
            f"16 bytes, got {config} and {w13.dtype}"
        )
    num_pairs = a.shape[0] * a_row_div
    rows = block_expert.shape[0] * config.block_m if out_by_slot else num_pairs
    if out.shape[0] != rows:
        raise ValueError(f"out has {out.shape[0]} rows where {rows} are stored")
    from triton.tools.tensor_descriptor import TensorDescriptor

    w_desc = TensorDescriptor.from_tensor(
        w13.view(experts * two_n, k), [config.block_n, config.block_k]
    )
    a_scale, w_scale, scale_strides = scale_args(scales, out)
    tiles = block_expert.shape[0] * (n // config.block_n)
    programs = max(1, min(_multiprocessors(out.device), tiles))
    _launch_within_shared_memory(
        moe_gate_up_tma_kernel, (programs,), ("gate_up", config, w13.dtype), config.num_stages,
        a, w_desc, out, sorted_pairs, block_expert, total, a_scale, w_scale, num_pairs,
        programs, n, k, a.stride(0), out.stride(0), *scale_strides, A_ROW_DIV=a_row_div,
        FP8_BLOCK=scales is not None, OUT_BY_SLOT=out_by_slot, EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, HALF_ROWS=bool(config.half_rows), num_warps=config.num_warps,
    )  # fmt: skip
