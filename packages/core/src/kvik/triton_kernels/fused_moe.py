"""The fused mixture of experts in Triton. Reference: ``kvik.ops.fused_moe``.

Six launches for a prefill-sized step, each sized from the number of tokens alone, never from
where they are routed, so a step replays under a CUDA graph (nothing is read back to the host):

1. ``moe_routing_kernel`` (8 or 32 tokens a program): per token, softmax over the router logits in
   fp32, the top-k experts by repeated arg-max, their weights renormalised where the model says;
   per program, a histogram of its pairs' experts (one row of partial counts).
2. ``moe_align_kernel`` (one program): pairs per expert (the partial counts added up), each
   expert's run padded to a multiple of the GEMM's row block, the runs' starts, the total, the
   expert of every row block (-1 past the total), and every row marked as padding.
3. ``moe_scatter_kernel``: each (token, k) pair takes the next slot of its expert's run (an atomic
   counter per expert). The order within a run is arbitrary, and harmless: every row of a tile
   computes the same sums in the same order whatever the other rows hold.
4. ``moe_gemm_kernel`` (gated): per row block, the gathered tokens times its expert's gate and up
   projections, ``silu(gate) * up`` in fp32, stored per (token, k) pair.
5. ``moe_gemm_kernel`` (weighted): those times the expert's down projection, scaled by the routing
   weight, stored per pair; the top-k rows of a token are then summed (``moe_sum_kernel``, in
   fp32, one rounding; each thread adds its columns row by row). Where the down configuration
   asks (``MoeConfig.tma``), step 4 stores its rows in the aligned order instead and step 5 is
   ``kvik.triton_kernels.fused_moe_tma``'s persistent GEMM with TMA loads.

Grids cover the most row blocks the routing could need (every pair's expert padded), and a
program past the device-side total returns at once.

Decode steps take fewer launches, since at one token the experts' bytes take ~18 µs on the H200
and every launch around them a few more (docs/benchmarks.md). Up to ``ROUTE_ALIGN_MAX_TOKENS``
tokens, steps 1-3 are one launch (``moe_route_align_kernel``, one program: the tokens' routing as
a [tokens, experts] tile, then the histogram, the runs and the scatter over the pairs it just
wrote). Up to ``SUM_LAST_MAX_TOKENS`` the down GEMM also does the sum (SUM_LAST: the last program
to finish a column block, counted with an atomic, adds that block's rows). One token takes two
launches in all: the gate/up GEMM's programs each route the token themselves (ONE_TOKEN: its top
k experts are distinct, so pair k is alone in row block k and nothing is aligned).

Block-FP8 experts (``fused_moe_fp8_block``) take the same launches with ``FP8_BLOCK`` set, plus
two activation quantizations (per token, groups of 128: before the gate/up GEMM and before the
down GEMM); the GEMMs multiply e4m3 tiles and scale each K step's product by its row group's
and weight tile's scales.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.ops import check_fused_moe_shapes

#: The grouped GEMMs' K steps without the K and column masks where the tiles divide K and N
#: (``moe_gemm_kernel``'s EVEN_K and EVEN_N); ``KVIK_MOE_UNMASKED_STEPS=0`` keeps the masks (an
#: A/B switch for timing, read at import).
UNMASKED_STEPS = os.environ.get("KVIK_MOE_UNMASKED_STEPS", "1") == "1"


@dataclass(frozen=True)
class MoeConfig:
    """A grouped GEMM's tiles: rows (pairs) by output columns by inner dimension, how many row
    blocks share a column sweep (L2 reuse of the expert's weights), warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    #: 1: each tile computed transposed (``_moe_tile``'s SWAP_AB), for row blocks of 16-32
    #: pairs, so they run on Hopper's wgmma (block_n a multiple of 64); 0 otherwise. A table
    #: row's seventh entry, absent (0) in rows written before it existed.
    swap_ab: int = 0
    #: 1: the gate/up GEMM computes gate and up as one product of twice the width
    #: (``_moe_tile``'s PAIRED); the down GEMM ignores it. A table row's eighth entry.
    paired: int = 0
    #: 1: a row block whose second half holds only padding (an expert's last block with at most
    #: block_m / 2 pairs) multiplies its first half alone (``moe_gemm_kernel``'s HALF_ROWS).
    #: A table row's ninth entry.
    half_rows: int = 0
    #: 1 in the down GEMM's configuration: the gate/up GEMM stores its output in the aligned
    #: order and the down GEMM runs persistent with TMA loads (``kvik.triton_kernels.fused_moe_tma``),
    #: on GPUs with TMA and where both GEMMs take the same block_m. 1 in the gate/up GEMM's: that
    #: GEMM runs persistent with the weights loaded by TMA (``moe_gate_up_tma``, with its half_rows;
    #: swap_ab and paired do not apply to it). Otherwise ignored. A table row's tenth entry.
    tma: int = 0

    def __post_init__(self) -> None:
        if self.half_rows and self.block_m < 32:
            # Half a block is a product's row count (or with swap_ab its column count), which
            # tl.dot takes from 16.
            raise ValueError(f"half_rows needs row blocks of 32 or more, not {self.block_m}")


#: (arch, num_tokens, num_experts, intermediate, hidden, top_k, dtype) -> (gate/up config, down
#: config): the launch configurations of the two grouped GEMMs on ``arch``.
MoeConfigChooser = Callable[
    [str, int, int, int, int, int, torch.dtype], tuple[MoeConfig, MoeConfig]
]


def interpreter_moe_config(
    arch: str, num_tokens: int, experts: int, inter: int, hidden: int, top_k: int, dtype
) -> tuple[MoeConfig, MoeConfig]:
    """Small tiles for the interpreter, where sizes cost time and nothing else."""
    config = MoeConfig(16, 32, 32, 1, 4, 1)
    return config, config


_CHOOSERS: dict[str, MoeConfigChooser] = {"interpreter": interpreter_moe_config}


def register_moe_configs(arch_prefix: str, chooser: MoeConfigChooser) -> None:
    """Make ``chooser`` pick the fused MoE's launch configurations on every architecture whose name
    starts with ``arch_prefix`` (registering again replaces); a GPU platform calls this when it is
    selected."""
    if not arch_prefix:
        raise ValueError("an architecture prefix must be non-empty, e.g. 'sm' or 'gfx'")
    _CHOOSERS[arch_prefix] = chooser
    moe_configs.cache_clear()


@functools.cache
def moe_configs(
    arch: str, num_tokens: int, experts: int, inter: int, hidden: int, top_k: int, dtype
) -> tuple[MoeConfig, MoeConfig]:
    """The registered chooser's (gate/up, down) configurations on ``arch`` (the longest matching
    prefix); cached, since every MoE layer of every step asks."""
    prefixes = sorted((p for p in _CHOOSERS if arch.startswith(p)), key=len, reverse=True)
    if not prefixes:
        raise RuntimeError(
            f"no fused MoE launch configuration is registered for architecture {arch!r} "
            f"(registered: {', '.join(sorted(_CHOOSERS))}); the platform that owns this GPU "
            "registers one when it is selected (e.g. kvik_cuda.registration.register_kernels())"
        )
    return _CHOOSERS[prefixes[0]](arch, num_tokens, experts, inter, hidden, top_k, dtype)


@triton.jit
def _route_rows(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    rows,
    num_tokens,
    num_experts,
    logits_stride,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Route the tokens ``rows`` (those below num_tokens): per token, softmax over the router
    logits in fp32, the top k by repeated arg-max (the lowest expert among equals), renormalised
    where the model says; weights and expert ids stored at [token, k]. Returns the ids as
    [rows, TOP_K_PAD] (zeros past TOP_K) and the tokens per expert [E_PAD]."""
    cols = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    x = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * logits_stride + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past the tokens: finite, never stored
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    # A NaN probability (NaN or infinite logits: a padded row of a CUDA graph holds whatever its
    # buffer held) counts as 0, so every id stays a real expert: NaN equals no maximum, and the
    # arg-max would give E_PAD, an expert past the weights that the alignment and the products
    # then index out of bounds (an illegal address on the GPU). The row's weights become NaN
    # (0 / 0 when renormalised, else 0) and its output is as undefined as its logits.
    p = tl.where(p == p, p, 0.0)
    p = tl.where(col_ok[None, :], p, -1.0)  # below any probability: never picked
    ks = tl.arange(0, TOP_K_PAD)
    top_w = tl.zeros([rows.shape[0], TOP_K_PAD], dtype=tl.float32)
    top_i = tl.zeros([rows.shape[0], TOP_K_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        index = tl.min(tl.where(p == best[:, None], cols[None, :], E_PAD), 1)
        top_w = tl.where(ks[None, :] == k, best[:, None], top_w)
        top_i = tl.where(ks[None, :] == k, index[:, None], top_i)
        p = tl.where(cols[None, :] == index[:, None], -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]
    out = rows[:, None].to(tl.int64) * TOP_K + ks[None, :]
    out_ok = row_ok[:, None] & (ks[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=out_ok)
    tl.store(ids_ptr + out, top_i, mask=out_ok)
    # The picked experts are the real columns marked -1 above: per expert, the tokens that
    # picked it (one reduction over the rows; a histogram of the ids compiled to twice the code).
    picked = (p < 0.0) & col_ok[None, :] & row_ok[:, None]
    return top_i, tl.sum(picked.to(tl.int32), 0)


@triton.jit
def moe_routing_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    counts_ptr,
    num_tokens,
    num_experts,
    logits_stride,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    COUNT: tl.constexpr,
):
    """ROWS tokens a program. With COUNT, the program also stores how many of its pairs went to
    each expert (row ``program`` of counts [programs, E_PAD]), which the alignment adds up
    instead of reading every pair again."""
    program = tl.program_id(0)
    rows = program * ROWS + tl.arange(0, ROWS)
    _, counts = _route_rows(
        logits_ptr, weights_ptr, ids_ptr, rows, num_tokens, num_experts, logits_stride, TOP_K,
        TOP_K_PAD, E_PAD, RENORMALIZE,
    )  # fmt: skip
    if COUNT:
        tl.store(counts_ptr + program * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def moe_count_kernel(ids_ptr, counts_ptr, num_pairs, E_BINS: tl.constexpr, CHUNK: tl.constexpr):
    """Row ``program`` of counts [programs, E_BINS]: the experts of CHUNK pairs (alignment
    without the routing's counts: the tuning script's given ids)."""
    program = tl.program_id(0)
    offs = program * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
    counts = tl.histogram(expert, E_BINS, mask=offs < num_pairs)
    tl.store(counts_ptr + program * E_BINS + tl.arange(0, E_BINS), counts)


@triton.jit
def _store_expert_runs(counts, bins, num_experts, cursor_ptr, total_ptr, BLOCK_M: tl.constexpr):
    """From each expert's pair count (bins past num_experts ignored): each expert's run of rows,
    padded to whole BLOCK_M blocks and laid end to end. Stores each run's start (the scatter's
    cursor) and the padded total; returns the runs' ends and the total."""
    padded = tl.where(bins < num_experts, tl.cdiv(counts, BLOCK_M) * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded, mask=bins < num_experts)
    tl.store(total_ptr, total)
    return ends, total


@triton.jit
def _store_block_experts(ends, total, block_expert_ptr, blocks, max_blocks, BLOCK_M: tl.constexpr):
    """Each row block's expert: the number of runs that end at or before its first row (-1 for
    blocks past the total). Returns the blocks' first rows."""
    first = blocks * BLOCK_M
    run = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
    tl.store(block_expert_ptr + blocks, tl.where(first < total, run, -1), mask=blocks < max_blocks)
    return first


@triton.jit
def _store_block_experts_and_padding(
    ends, total, block_expert_ptr, sorted_ptr, num_pairs, max_blocks,
    BLOCK_M: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
):  # fmt: skip
    """Every row block's expert, and every row marked as padding (the pair count): the scatter
    that follows overwrites the rows that get a pair."""
    for b0 in range(0, max_blocks, BLOCKS_CHUNK):
        blocks = b0 + tl.arange(0, BLOCKS_CHUNK)
        first = _store_block_experts(ends, total, block_expert_ptr, blocks, max_blocks, BLOCK_M)
        rows_of_blocks = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
        padding = tl.full([BLOCKS_CHUNK, BLOCK_M], 0, tl.int32) + num_pairs
        tl.store(sorted_ptr + rows_of_blocks, padding, mask=(blocks < max_blocks)[:, None])


@triton.jit
def moe_align_kernel(
    counts_ptr,
    cursor_ptr,
    block_expert_ptr,
    total_ptr,
    sorted_ptr,
    num_count_rows,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_BINS: tl.constexpr,
    COUNT_ROWS: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
):
    """One program: the pairs per expert (the rows of partial counts added up), then the runs,
    the cursors, each row block's expert and the padding rows."""
    bins = tl.arange(0, E_BINS)
    counts = tl.zeros([E_BINS], dtype=tl.int32)
    for start in range(0, num_count_rows, COUNT_ROWS):
        rows = start + tl.arange(0, COUNT_ROWS)
        partial = tl.load(
            counts_ptr + rows[:, None] * E_BINS + bins[None, :],
            mask=(rows < num_count_rows)[:, None],
            other=0,
        )
        counts += tl.sum(partial, 0)
    ends, total = _store_expert_runs(counts, bins, num_experts, cursor_ptr, total_ptr, BLOCK_M)
    _store_block_experts_and_padding(
        ends, total, block_expert_ptr, sorted_ptr, num_pairs, max_blocks, BLOCK_M, BLOCKS_CHUNK
    )


@triton.jit
def moe_route_align_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    total_ptr,
    cursor_ptr,
    num_tokens,
    num_experts,
    logits_stride,
    max_blocks,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKENS_PAD: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
):
    """``moe_routing_kernel``, ``moe_align_kernel``, the padding fill and ``moe_scatter_kernel``
    in one program, for at most TOKENS_PAD tokens (PAIRS_PAD >= TOKENS_PAD * TOP_K)."""
    # Routing, every token at once.
    _ = _route_rows(
        logits_ptr, weights_ptr, ids_ptr, tl.arange(0, TOKENS_PAD), num_tokens, num_experts,
        logits_stride, TOP_K, TOP_K_PAD, E_PAD, RENORMALIZE,
    )  # fmt: skip
    tl.debug_barrier()  # the ids just stored are read back by other threads below
    # Alignment: as moe_align_kernel, over the pairs in one block.
    num_pairs = num_tokens * TOP_K
    pairs = tl.arange(0, PAIRS_PAD)
    pair_ok = pairs < num_pairs
    expert = tl.load(ids_ptr + pairs, mask=pair_ok, other=0)
    counts = tl.histogram(expert, E_PAD, mask=pair_ok)
    ends, total = _store_expert_runs(
        counts, tl.arange(0, E_PAD), num_experts, cursor_ptr, total_ptr, BLOCK_M
    )
    _store_block_experts_and_padding(
        ends, total, block_expert_ptr, sorted_ptr, num_pairs, max_blocks, BLOCK_M, BLOCKS_CHUNK
    )
    tl.debug_barrier()  # the cursors and the padding are in place before the scatter
    slot = tl.atomic_add(cursor_ptr + expert, 1, mask=pair_ok)
    tl.store(sorted_ptr + slot, pairs, mask=pair_ok)


@triton.jit
def moe_scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    slot = tl.atomic_add(cursor_ptr + expert, 1, mask=mask)
    tl.store(sorted_ptr + slot, offs, mask=mask)


@triton.jit
def _step_product(a, w, acc, a_scale, w_scale, FP8_BLOCK: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc`` plus one K step's product: a [BLOCK_M, BLOCK_K] by w [BLOCK_K, BLOCK_N], or with
    SWAP_AB its transpose, w [BLOCK_N, BLOCK_K] by a [BLOCK_K, BLOCK_M]. FP8_BLOCK: the e4m3
    product scaled by the rows' and the weight tile's scales before it joins the fp32 sum."""
    if SWAP_AB:
        if FP8_BLOCK:
            acc += tl.dot(w, a) * w_scale[:, None] * a_scale[None, :]
        else:
            acc = tl.dot(w, a, acc, input_precision="ieee")
    elif FP8_BLOCK:
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    else:
        acc = tl.dot(a, w, acc, input_precision="ieee")  # fp32 without TF32
    return acc


@triton.jit
def _moe_tile(
    a_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    a_scale_ptr,
    w_scale_ptr,
    expert,
    pair,
    row_ok,
    out_row,
    pid_n,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_asm,
    stride_wse,
    stride_wsn,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """One [BLOCK_M pairs, BLOCK_N columns] tile of ``moe_gemm_kernel``, stored in rows
    ``out_row`` (the pairs, or with OUT_BY_SLOT their aligned slots).

    The loads take no row mask: a padding row reads A's row 0 instead (its results are never
    stored, and no row's sums depend on another's). EVEN_K (BLOCK_K divides K) and EVEN_N
    (BLOCK_N divides N) drop the K and column masks too, so a K step's loads carry no
    predicates: on an H100 the op 1% faster in bf16 and 4-6% in block FP8 at 4096-8192 tokens
    (docs/benchmarks.md, the forty-sixth session).

    SWAP_AB computes the tile's transpose: the BLOCK_N weight rows are the MMA's M side (64 rows
    a Hopper warpgroup) and the pairs its N side, so that a row block of 16 pairs still runs on
    wgmma. Unswapped, 16 rows run on mma.sync, which has no e4m3 form on Hopper: the FP8 weights
    were converted to f16 on the CUDA cores, 96 conversions a K step in the PTX (as the dense
    few-rows kernel, kvik.triton_kernels.fp8_skinny, found).

    PAIRED (GATED): gate and up as one product of 2 * BLOCK_N columns, each column's gate and up
    weight rows interleaved, split after the loop: one MMA of twice the width (m64n128 for
    BLOCK_N = 64 on Hopper) reads the activations' tile from shared memory once, not twice."""
    expert = expert.to(tl.int64)
    a_row = tl.where(row_ok, pair // A_ROW_DIV, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = (cols < N) | EVEN_N
    ks = tl.arange(0, BLOCK_K)
    # The weight rows of the product: the tile's columns, or PAIRED (GATED) each column's gate
    # row and up row interleaved, 2 * BLOCK_N of them, so gate and up are one product.
    if PAIRED:
        j = tl.arange(0, 2 * BLOCK_N)
        w_rows = pid_n * BLOCK_N + j // 2 + (j % 2) * N
        w_ok = (pid_n * BLOCK_N + j // 2 < N) | EVEN_N
    else:
        w_rows = cols
        w_ok = col_ok
    if SWAP_AB:
        a_ptrs = a_ptr + a_row[None, :] * stride_am + ks[:, None]
        w_ptrs = w_ptr + expert * stride_we + w_rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
        acc = tl.zeros([BLOCK_N * (1 + PAIRED), BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :]
        w_ptrs = w_ptr + expert * stride_we + w_rows[None, :].to(tl.int64) * stride_wn + ks[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N * (1 + PAIRED)], dtype=tl.float32)
    separate_up: tl.constexpr = GATED and not PAIRED
    acc_up = tl.zeros_like(acc)
    if FP8_BLOCK:
        a_scale_ptrs = a_scale_ptr + a_row * stride_asm
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + (w_rows // 128) * stride_wsn
        w_up_scale_ptrs = w_scale_ptr + expert * stride_wse + ((N + cols) // 128) * stride_wsn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # Under EVEN_K and EVEN_N the masks are constants, all true, which the compiler drops.
        k_ok = (ks < K - k * BLOCK_K) | EVEN_K
        if SWAP_AB:
            a = tl.load(a_ptrs, mask=k_ok[:, None], other=0.0)
            w_mask = w_ok[:, None] & k_ok[None, :]
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & w_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if FP8_BLOCK:
            group = k * BLOCK_K // 128
            a_scale = tl.load(a_scale_ptrs + group)
            w_scale = tl.load(w_scale_ptrs + group, mask=w_ok, other=0.0)
        else:
            a_scale = 0.0  # not read
            w_scale = 0.0
        acc = _step_product(a, w, acc, a_scale, w_scale, FP8_BLOCK, SWAP_AB)
        if separate_up:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            if FP8_BLOCK:
                w_up_scale = tl.load(w_up_scale_ptrs + group, mask=col_ok, other=0.0)
            else:
                w_up_scale = 0.0
            acc_up = _step_product(a, w_up, acc_up, a_scale, w_up_scale, FP8_BLOCK, SWAP_AB)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if separate_up:
        acc = acc * tl.sigmoid(acc) * acc_up
    if SWAP_AB:
        acc = tl.trans(acc)
    if PAIRED:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        acc = gate * tl.sigmoid(gate) * up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + out_row.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,  # unless ONE_TOKEN: the aligned pairs (align_to_blocks)
    block_expert_ptr,
    total_ptr,
    weights_ptr,  # WEIGHTED: the pairs' routing weights; ROUTE: where they are stored
    a_scale_ptr,  # FP8_BLOCK: [rows of A, ceil(K/128)] fp32; else unused
    w_scale_ptr,  # FP8_BLOCK: [E, ceil(rows of W/128), ceil(K/128)] fp32; else unused
    logits_ptr,  # ROUTE: the token's router logits [E]
    ids_ptr,  # ONE_TOKEN: the token's experts [TOP_K] (ROUTE stores them, else read)
    sum_ptr,  # SUM_LAST: [tokens, N], each token's TOP_K pair rows added
    counter_ptr,  # SUM_LAST: one int32 per column block, zero on entry
    num_pairs,
    max_blocks,
    N,
    K,
    num_experts,
    num_counters,  # ZERO_COUNTERS: how many of counter_ptr's int32 to zero
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_asm,
    stride_wse,
    stride_wsn,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PAIRED: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
    ROUTE: tl.constexpr,
    SUM_LAST: tl.constexpr,
    ZERO_COUNTERS: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKENS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    # The expert's last row block, where its second half is padding, multiplied as a block of
    # BLOCK_M / 2 rows (a second compiled copy of the tile): with 128-row blocks and 256 pairs an
    # expert on average (4096 tokens of Qwen3-30B-A3B), 21% of the rows multiplied were padding.
    HALF_ROWS: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,  # BLOCK_K divides K: K steps without masks (``_moe_tile``)
    EVEN_N: tl.constexpr = False,  # BLOCK_N divides N: weight loads without column masks
    # Row r of a row block stored at out row pid_m * BLOCK_M + r (the aligned order, which
    # ``moe_down_tma`` reads with TMA), not at its pair's row. Not with ONE_TOKEN.
    OUT_BY_SLOT: tl.constexpr = False,
):
    """out[pair, :N] = A[pair // A_ROW_DIV] @ W[expert]^T for the pairs of each row block.

    GATED: W's rows [0, N) are the gate and [N, 2N) the up projection, out = silu(gate) * up.
    WEIGHTED: out is scaled by the pair's routing weight.
    FP8_BLOCK: A is e4m3 with one scale per row and 128 columns, W e4m3 with one scale per
    128 x 128 tile of each expert; each BLOCK_K step (BLOCK_K divides 128, so it lies in one
    group) adds its e4m3 product times the two scales.

    ONE_TOKEN: a step of one token, whose TOP_K experts are distinct, so pair k is alone in row
    block k (max_blocks = TOP_K) and nothing is aligned: the expert of block k is ids[k], or with
    ROUTE (the first GEMM) every program routes the token itself (a softmax over E logits, far
    cheaper than a launch of its own) and stores the weights and ids for the second.
    SUM_LAST (decode-sized steps): the last program to finish a column block, counted on its
    counter, adds each token's TOP_K rows of out in fp32 into sum_ptr, so no launch of
    ``moe_sum_kernel`` follows. ZERO_COUNTERS: program 0 zeroes the next GEMM's
    counters (a launch earlier on the stream, so they are zero before it starts)."""
    pid = tl.program_id(0)
    if ZERO_COUNTERS:
        if pid == 0:
            for c0 in range(0, num_counters, 128):
                c = c0 + tl.arange(0, 128)
                tl.store(counter_ptr + c, tl.zeros([128], tl.int32), mask=c < num_counters)
    blocks_n = tl.cdiv(N, BLOCK_N)
    # Row blocks in groups of GROUP_M sweep the columns together, sharing the weights in L2.
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if ONE_TOKEN:
        within = tl.arange(0, BLOCK_M)
        pair = tl.where(within == 0, pid_m, num_pairs)
        if ROUTE:
            # Every program stores the same weights and ids (for the second GEMM). Ranking the
            # experts instead (two reductions over an [E, E] comparison rather than 2 * TOP_K
            # small ones) measured 2-4 µs slower a call on the H200 (docs/benchmarks.md).
            top_i, _ = _route_rows(
                logits_ptr, weights_ptr, ids_ptr, tl.arange(0, 1), 1, num_experts, 0, TOP_K,
                TOP_K_PAD, E_PAD, RENORMALIZE,
            )  # fmt: skip
            expert = tl.sum(tl.where(tl.arange(0, TOP_K_PAD)[None, :] == pid_m, top_i, 0))
        else:
            expert = tl.load(ids_ptr + pid_m)
        _moe_tile(
            a_ptr, w_ptr, out_ptr, weights_ptr, a_scale_ptr, w_scale_ptr, expert, pair,
            within == 0, pair, pid_n, N, K, stride_am, stride_we, stride_wn, stride_om,
            stride_asm, stride_wse, stride_wsn, A_ROW_DIV, GATED, WEIGHTED, FP8_BLOCK, SWAP_AB,
            PAIRED, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N,
        )  # fmt: skip
    elif pid_m * BLOCK_M < tl.load(total_ptr):
        expert = tl.load(block_expert_ptr + pid_m)
        first = sorted_ptr + pid_m * BLOCK_M
        # A run's pairs fill its first slots (the scatter's counter), so a block whose middle
        # slot is padding has pairs in its first half only.
        half = False
        if HALF_ROWS:
            half = tl.load(first + BLOCK_M // 2) >= num_pairs
        if half:
            half_pair = tl.load(first + tl.arange(0, BLOCK_M // 2))
            half_out = half_pair
            if OUT_BY_SLOT:
                half_out = pid_m * BLOCK_M + tl.arange(0, BLOCK_M // 2)
            _moe_tile(
                a_ptr, w_ptr, out_ptr, weights_ptr, a_scale_ptr, w_scale_ptr, expert, half_pair,
                half_pair < num_pairs, half_out, pid_n, N, K, stride_am, stride_we, stride_wn,
                stride_om, stride_asm, stride_wse, stride_wsn, A_ROW_DIV, GATED, WEIGHTED,
                FP8_BLOCK, SWAP_AB, PAIRED, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N,
            )  # fmt: skip
        else:
            pair = tl.load(first + tl.arange(0, BLOCK_M))
            out_row = pair
            if OUT_BY_SLOT:
                out_row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            _moe_tile(
                a_ptr, w_ptr, out_ptr, weights_ptr, a_scale_ptr, w_scale_ptr, expert, pair,
                pair < num_pairs, out_row, pid_n, N, K, stride_am, stride_we, stride_wn,
                stride_om, stride_asm, stride_wse, stride_wsn, A_ROW_DIV, GATED, WEIGHTED,
                FP8_BLOCK, SWAP_AB, PAIRED, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N,
            )  # fmt: skip
    if SUM_LAST:
        # Every program of the column block counts, those past the pairs too. The barrier puts
        # all of this program's stores before its count; the count's acquire-release ordering
        # makes every counted program's stores visible to the program that counts last.
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr + pid_n, 1) == max_blocks - 1:
            # Every token's rows in one load: a loop over the tokens would wait on L2 once each.
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tokens = tl.arange(0, TOKENS_PAD)
            ks = tl.arange(0, TOP_K_PAD)
            rows = tokens[:, None] * TOP_K + ks[None, :]
            row_ok = (tokens[:, None] < num_pairs // TOP_K) & (ks[None, :] < TOP_K)
            # .cg: from L2, where the other programs' rows are (never a stale L1 line).
            x = tl.load(
                out_ptr + rows[:, :, None].to(tl.int64) * stride_om + cols[None, None, :],
                mask=row_ok[:, :, None] & (cols < N)[None, None, :], other=0.0,
                cache_modifier=".cg",
            )  # fmt: skip
            total = tl.sum(x.to(tl.float32), axis=1)
            tl.store(
                sum_ptr + tokens[:, None] * N + cols[None, :],
                total.to(sum_ptr.dtype.element_ty),
                mask=(tokens[:, None] < num_pairs // TOP_K) & (cols < N)[None, :],
            )


ROUTING_WARPS = 4
#: Tokens a routing program takes (``routing_rows``): few where a step has few tokens, so that
#: its programs stay many and short; more above ROUTING_FEW_TOKENS, where one token a program
#: took 19 µs at 4096 tokens on the H200 (4096 programs) and each program adds a row of counts
#: for the alignment to read (128 rows at 4096 tokens). Not yet timed on a GPU.
ROUTING_ROWS_FEW, ROUTING_ROWS_MANY, ROUTING_FEW_TOKENS = 8, 32, 1024


def routing_rows(tokens: int) -> int:
    return ROUTING_ROWS_FEW if tokens <= ROUTING_FEW_TOKENS else ROUTING_ROWS_MANY


ALIGN_WARPS = 8
#: Rows of partial counts the alignment adds a loop step (a [64, 128] tile for 128 experts).
ALIGN_COUNT_ROWS = 64
#: Pairs a counting program takes (alignment from ids alone).
COUNT_CHUNK = 1024
ALIGN_BLOCKS_CHUNK = 64
SCATTER_BLOCK = 1024
SCATTER_WARPS = 4
#: Steps of at most this many tokens route and align in one launch (moe_route_align_kernel).
ROUTE_ALIGN_MAX_TOKENS = 16
ROUTE_ALIGN_WARPS = 4
#: Steps of at most this many tokens add their top-k rows in the down GEMM (SUM_LAST). On the
#: H200 it saved 0.5-5 µs a call at 1-2 tokens and cost 3-4 µs at 4 (each program's count
#: before it exits); 8-16 tokens came out even (docs/benchmarks.md).
SUM_LAST_MAX_TOKENS = 2


@triton.jit
def moe_sum_kernel(pairs_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[token, cols] = the sum of the token's TOP_K pair rows (pairs [tokens * TOP_K, N]) over
    one block of columns, in fp32 in the order k = 0, 1, ..., rounded once.

    Each thread adds its own columns row by row, so nothing crosses threads. The first form
    loaded the [TOP_K, BLOCK_N] block at once and reduced it along the rows (``tl.sum`` over
    axis 0, through shared memory): on the H200 it took 20.4 µs a call at 256 tokens
    (Qwen3-30B-A3B's 2048 columns: 8.4 MB read, 0.4 TB/s) and 6.0 at 64, where this one takes
    2.4 and 1.6 (docs/benchmarks.md)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(pairs_ptr + (token * TOP_K + k) * N + cols, mask=col_ok, other=0.0)
        total += row.to(tl.float32)
    tl.store(out_ptr + token * N + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


#: Columns a ``moe_sum_kernel`` program adds (one token's; 2048 columns are 4 programs). 256 to
#: 2048 columns with 4 or 8 warps all took 2.3-2.4 µs at 256 tokens on the H200, 512 with 4 warps
#: among the fastest at 64 tokens too (1.6 µs).
SUM_BLOCK_N = 512
SUM_WARPS = 4


def moe_sum(pairs: Tensor, tokens: int, top_k: int) -> Tensor:
    """The top-k rows of each token summed: pairs [tokens * top_k, N] -> [tokens, N]. A small
    launch of its own: ``Tensor.sum`` over the [tokens, top_k, N] view (PyTorch's generic
    reduction) took 4.4 µs a call at one token in Qwen3-30B-A3B's decode step on the H200, and
    4.4 at 256 tokens where ``moe_sum_kernel`` takes 2.4."""
    n = pairs.shape[1]
    out = torch.empty(tokens, n, dtype=pairs.dtype, device=pairs.device)
    grid = (tokens, triton.cdiv(n, SUM_BLOCK_N))
    moe_sum_kernel[grid](pairs, out, n, TOP_K=top_k, BLOCK_N=SUM_BLOCK_N, num_warps=SUM_WARPS)
    return out


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most row blocks any routing of ``num_pairs`` pairs needs: each non-empty expert's run
    is padded by at most block_m - 1 rows, and at most min(pairs, experts) are non-empty."""
    return triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)


def align_constexprs(num_experts: int, block_m: int) -> dict[str, int]:
    return {
        "BLOCK_M": block_m,
        "E_BINS": triton.next_power_of_2(num_experts),
        "COUNT_ROWS": ALIGN_COUNT_ROWS,
        "BLOCKS_CHUNK": ALIGN_BLOCKS_CHUNK,
    }


def _launch_routing(
    router_logits: Tensor, top_k: int, renormalize: bool, count: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    router_logits = router_logits.contiguous()
    tokens, experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(experts)
    rows = routing_rows(tokens)
    programs = triton.cdiv(tokens, rows)
    counts = torch.empty(programs, e_pad, dtype=torch.int32, device=device) if count else None
    if tokens:
        moe_routing_kernel[(programs,)](
            router_logits, weights, ids, ids if counts is None else counts, tokens, experts,
            router_logits.stride(0), TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k),
            E_PAD=e_pad, RENORMALIZE=renormalize, ROWS=rows, COUNT=count,
            num_warps=ROUTING_WARPS,
        )  # fmt: skip
    return weights, ids, counts


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(weights [T, top_k] fp32, expert ids [T, top_k] int32), as ``kvik.ops.moe_routing``."""
    weights, ids, _ = _launch_routing(router_logits, top_k, renormalize, count=False)
    return weights, ids


def route_and_count(
    router_logits: Tensor, top_k: int, renormalize: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``route``, and the pairs each routing program (``routing_rows(T)`` tokens) sent to each
    expert (counts [programs, next_power_of_2(experts)] int32) for ``align_to_blocks``: one
    launch."""
    weights, ids, counts = _launch_routing(router_logits, top_k, renormalize, count=True)
    assert counts is not None
    return weights, ids, counts


def align_to_blocks(
    ids: Tensor, num_experts: int, block_m: int, counts: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The (token, k) pairs of ``ids`` [T, top_k] grouped by expert into runs padded to
    ``block_m`` rows: (sorted pairs [max rows], holding num_pairs where padded; the expert of each
    row block [max blocks], -1 past the end; the rows in use [1]), all on the device.
    ``counts``: ``route_and_count``'s partial counts of these ids (else a launch counts them)."""
    num_pairs = ids.numel()
    blocks = max_row_blocks(num_pairs, num_experts, block_m)
    device = ids.device
    e_bins = triton.next_power_of_2(num_experts)
    if counts is None:
        programs = triton.cdiv(num_pairs, COUNT_CHUNK)
        counts = torch.empty(programs, e_bins, dtype=torch.int32, device=device)
        moe_count_kernel[(programs,)](
            ids, counts, num_pairs, E_BINS=e_bins, CHUNK=COUNT_CHUNK, num_warps=ALIGN_WARPS
        )
    if counts.shape[1:] != (e_bins,) or counts.dtype != torch.int32:
        raise ValueError(f"counts must be [programs, {e_bins}] int32, got {tuple(counts.shape)}")
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    moe_align_kernel[(1,)](
        counts, cursor, block_expert, total, sorted_pairs, counts.shape[0], num_pairs,
        num_experts, blocks, **align_constexprs(num_experts, block_m), num_warps=ALIGN_WARPS,
    )  # fmt: skip
    moe_scatter_kernel[(triton.cdiv(num_pairs, SCATTER_BLOCK),)](
        ids, cursor, sorted_pairs, num_pairs, BLOCK=SCATTER_BLOCK, num_warps=SCATTER_WARPS
    )
    return sorted_pairs, block_expert, total


def route_and_align(
    router_logits: Tensor, top_k: int, renormalize: bool, num_experts: int, block_m: int
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``route`` then ``align_to_blocks`` in one launch, for 2 to ROUTE_ALIGN_MAX_TOKENS tokens
    (one token routes inside its first GEMM): (weights, ids, (sorted pairs, block experts,
    total))."""
    router_logits = router_logits.contiguous()
    tokens = router_logits.shape[0]
    if not 1 < tokens <= ROUTE_ALIGN_MAX_TOKENS:
        raise ValueError(
            f"route_and_align takes 2 to {ROUTE_ALIGN_MAX_TOKENS} tokens, not {tokens}"
        )
    device = router_logits.device
    num_pairs = tokens * top_k
    blocks = max_row_blocks(num_pairs, num_experts, block_m)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)  # the scatter's
    tokens_pad = triton.next_power_of_2(ROUTE_ALIGN_MAX_TOKENS)
    moe_route_align_kernel[(1,)](
        router_logits, weights, ids, sorted_pairs, block_expert, total, cursor, tokens,
        num_experts, router_logits.stride(0), blocks, TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize, TOKENS_PAD=tokens_pad,
        PAIRS_PAD=triton.next_power_of_2(tokens_pad * top_k), BLOCK_M=block_m,
        BLOCKS_CHUNK=ALIGN_BLOCKS_CHUNK, num_warps=ROUTE_ALIGN_WARPS,
    )  # fmt: skip
    return weights, ids, (sorted_pairs, block_expert, total)


@dataclass
class OneTokenRouting:
    """A step of one token (``moe_gemm_kernel``'s ONE_TOKEN): its expert ids [1, top_k] int32
    and routing weights [1, top_k] fp32, which the first GEMM computes from ``router_logits``
    (``route`` set) and the second reads."""

    ids: Tensor
    weights: Tensor
    router_logits: Tensor
    renormalize: bool


@dataclass
class SumInLastProgram:
    """The top-k sum done by the second GEMM's last program per column block (SUM_LAST):
    ``out`` [tokens, N] receives it; ``counters`` (int32, one per column block) are zeroed by
    the first GEMM (ZERO_COUNTERS), so they need no memset launch of their own."""

    out: Tensor
    counters: Tensor


def step_constexprs(
    one_token: bool,
    gated: bool,
    sum_last: bool,
    zero_counters: bool,
    top_k: int,
    experts: int,
    renormalize: bool,
    tokens: int,
) -> dict[str, int | bool]:
    """``moe_gemm_kernel``'s constexprs for the step's size: ONE_TOKEN (routing in the gated
    GEMM), SUM_LAST and ZERO_COUNTERS (decode-sized steps), and the routing's sizes."""
    return {
        "ONE_TOKEN": one_token, "ROUTE": one_token and gated, "SUM_LAST": sum_last,
        "ZERO_COUNTERS": zero_counters, "TOP_K": top_k, "TOP_K_PAD": triton.next_power_of_2(top_k),
        "E_PAD": triton.next_power_of_2(experts), "RENORMALIZE": bool(renormalize),
        # SUM_LAST's tokens (a power of two, so a few compiled variants); 1 where unused.
        "TOKENS_PAD": triton.next_power_of_2(tokens) if sum_last else 1,
    }  # fmt: skip


def even_tiles(n: int, k: int, config: MoeConfig) -> dict[str, bool]:
    """``moe_gemm_kernel``'s EVEN_K and EVEN_N for a product of ``n`` columns over ``k``."""
    return {
        "EVEN_K": UNMASKED_STEPS and k % config.block_k == 0,
        "EVEN_N": UNMASKED_STEPS and n % config.block_n == 0,
    }


def scale_args(
    scales: tuple[Tensor, Tensor] | None, unused: Tensor
) -> tuple[Tensor, Tensor, tuple[int, int, int]]:
    """A grouped GEMM's (a_scale, w_scale, (stride_asm, stride_wse, stride_wsn)) arguments:
    ``scales``' (block FP8), else ``unused`` in their place and zero strides."""
    if scales is None:
        return unused, unused, (0, 0, 0)  # not read unless FP8_BLOCK
    a_scale, w_scale = scales
    if a_scale.stride(1) != 1 or w_scale.stride(2) != 1:
        # The kernels step through K's scale groups at unit stride.
        raise ValueError("block-FP8 scales must be contiguous along K (row-major groups)")
    return a_scale, w_scale, (a_scale.stride(0), w_scale.stride(0), w_scale.stride(1))


def grouped_gemm(
    a: Tensor,
    w: Tensor,
    out: Tensor,
    aligned: tuple[Tensor, Tensor, Tensor] | None,
    weights: Tensor | None,
    a_row_div: int,
    gated: bool,
    config: MoeConfig,
    scales: tuple[Tensor, Tensor] | None = None,
    *,
    top_k: int = 1,
    one_token: OneTokenRouting | None = None,
    sum_last: SumInLastProgram | None = None,
    zero_counters: Tensor | None = None,
    out_by_slot: bool = False,
) -> None:
    """One grouped GEMM over the pairs ``aligned`` by ``align_to_blocks`` (None with
    ``one_token``: pair k alone in row block k; a gated GEMM routes the token itself).
    ``scales``: (A's per-row-group scales, W's tile scales) for block-FP8 operands. ``sum_last``:
    also add each token's ``top_k`` rows of ``out`` (the second GEMM of a decode-sized step);
    ``zero_counters``: zero those counters (the first GEMM, so the second finds them zero).
    ``out_by_slot``: ``out`` [row blocks * block_m, N] takes each row at its aligned slot, for
    ``moe_down_tma``."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    # The pairs: each is a row of A once a_row_div is applied, and the padding slots hold this
    # count, which the kernel tells from a pair by it. Not out's rows: out_by_slot's out has a
    # row per slot, and with that count a padding slot passed for a pair of a token one past A's
    # end (read out of bounds: an H100's illegal memory access, docs/benchmarks.md, the
    # forty-ninth session).
    num_pairs = a.shape[0] * a_row_div
    if not out_by_slot and out.shape[0] != num_pairs:
        raise ValueError(f"out has {out.shape[0]} rows for {num_pairs} pairs")
    if one_token is not None:
        blocks = top_k
        sorted_pairs = block_expert = total = out  # not read
    else:
        sorted_pairs, block_expert, total = aligned
        blocks = block_expert.shape[0]
    grid = (blocks * triton.cdiv(n, config.block_n),)
    a_scale, w_scale, scale_strides = scale_args(scales, out)
    route = one_token is not None and gated
    if route:
        weights = one_token.weights  # where the routing stores them
        logits = one_token.router_logits
    else:
        logits = out  # not read
    ids = out if one_token is None else one_token.ids
    counters = zero_counters if sum_last is None else sum_last.counters
    num_experts = w.shape[0]
    moe_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, total,
        out if weights is None else weights,  # not read unless WEIGHTED or ROUTE
        a_scale, w_scale, logits, ids,
        out if sum_last is None else sum_last.out,
        out if counters is None else counters,
        num_pairs, blocks, n, k, num_experts,
        0 if zero_counters is None else zero_counters.numel(),
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), *scale_strides,
        A_ROW_DIV=a_row_div, GATED=gated, WEIGHTED=weights is not None and not route,
        FP8_BLOCK=scales is not None, SWAP_AB=bool(config.swap_ab),
        PAIRED=bool(gated and config.paired),
        **step_constexprs(
            one_token is not None, gated, sum_last is not None, zero_counters is not None, top_k,
            num_experts, one_token is not None and one_token.renormalize, num_pairs // top_k,
        ),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, HALF_ROWS=bool(config.half_rows) and one_token is None,
        **even_tiles(n, k, config), OUT_BY_SLOT=out_by_slot,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


#: ``KVIK_MOE_TMA``: "table" (the default) takes each down configuration's ``tma``; "0" never
#: runs ``moe_down_tma``, "1" runs it wherever it can. ``KVIK_MOE_TMA_UP``: the same for the
#: gate/up GEMM's ``moe_gate_up_tma``. A/B switches for timing, read at import.
TMA_DOWN = os.environ.get("KVIK_MOE_TMA", "table")
TMA_UP = os.environ.get("KVIK_MOE_TMA_UP", "table")


def use_tma_down(
    up_config: MoeConfig, down_config: MoeConfig, hidden: Tensor, w2: Tensor, tokens: int
) -> bool:
    """Whether the step's down GEMM runs as ``moe_down_tma`` (the gate/up GEMM then stores its
    output in the aligned order): where the configuration asks (or ``KVIK_MOE_TMA=1``), the step
    is not a one-token step, both GEMMs align to the same block_m, ``down_tma_fits``, and the
    device has TMA.

    The block-FP8 form once faulted (illegal memory access) at 8192 tokens on an H100: the
    gate/up GEMM storing by slot counted pairs by out's rows, so a padding slot passed for a pair
    of a token one past A's end and its row was read (in bf16 too, where the read landed inside a
    neighbouring allocation). ``grouped_gemm`` counts pairs from A since; the sequence that
    faulted ran clean on an H200 with it (docs/benchmarks.md, the fiftieth session)."""
    from kvik.triton_kernels.fused_moe_tma import down_tma_fits, tma_supported

    wanted = TMA_DOWN == "1" or (TMA_DOWN == "table" and bool(down_config.tma))
    return (
        wanted
        and tokens > 1
        and up_config.block_m == down_config.block_m
        and down_tma_fits(w2.shape[1], w2.shape[2], w2.element_size(), down_config)
        and tma_supported(hidden.device)
    )


def use_tma_gate_up(up_config: MoeConfig, hidden: Tensor, w13: Tensor, tokens: int) -> bool:
    """Whether the step's gate/up GEMM runs as ``moe_gate_up_tma``: where its configuration asks
    (or ``KVIK_MOE_TMA_UP=1``), the step is not a one-token step (those route inside the GEMM),
    ``gate_up_tma_fits``, and the device has TMA."""
    from kvik.triton_kernels.fused_moe_tma import gate_up_tma_fits, tma_supported

    wanted = TMA_UP == "1" or (TMA_UP == "table" and bool(up_config.tma))
    return (
        wanted
        and tokens > 1
        and gate_up_tma_fits(w13.shape[1] // 2, w13.shape[2], w13.element_size(), up_config)
        and tma_supported(hidden.device)
    )


def _experts(
    hidden: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w2: Tensor,
    top_k: int,
    renormalize: bool,
    configs: tuple[MoeConfig, MoeConfig],
    fp8_scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Routing, both grouped GEMMs and the top-k sum, in as few launches as the step's size
    allows: one token routes inside the gate/up GEMM; up to ROUTE_ALIGN_MAX_TOKENS tokens route
    and align in one launch; larger steps route, align and scatter in three. Up to
    SUM_LAST_MAX_TOKENS the down GEMM's last programs add the top-k rows, else a launch does.
    ``fp8_scales``: the experts' block scales (w13's, w2's): the activations are quantized per
    token group before each GEMM."""
    from kvik.triton_kernels.fp8_quant import per_token_group_quant_fp8

    tokens, size = hidden.shape
    experts, inter = w13.shape[0], w2.shape[2]
    up_config, down_config = configs
    device = hidden.device
    num_pairs = tokens * top_k
    one_token, counts = None, None
    if tokens == 1:
        one_token = OneTokenRouting(
            torch.empty(1, top_k, dtype=torch.int32, device=device),
            torch.empty(1, top_k, dtype=torch.float32, device=device),
            router_logits.contiguous(),
            renormalize,
        )
        weights, ids, aligned = one_token.weights, one_token.ids, None
    elif tokens <= ROUTE_ALIGN_MAX_TOKENS:
        weights, ids, aligned = route_and_align(
            router_logits, top_k, renormalize, experts, up_config.block_m
        )
    else:
        weights, ids, counts = route_and_count(router_logits, top_k, renormalize)
        aligned = align_to_blocks(ids, experts, up_config.block_m, counts)
    tma_down = use_tma_down(up_config, down_config, hidden, w2, tokens)
    tma_up = use_tma_gate_up(up_config, hidden, w13, tokens)
    sum_last = None
    # SUM_LAST's counters are zeroed by the pointer form of the gate/up GEMM, and summed by the
    # pointer form of the down GEMM.
    if top_k > 1 and tokens <= SUM_LAST_MAX_TOKENS and not (tma_down or tma_up):
        sum_last = SumInLastProgram(
            torch.empty(tokens, size, dtype=hidden.dtype, device=device),
            torch.empty(triton.cdiv(size, down_config.block_n), dtype=torch.int32, device=device),
        )
    a, up_scales, down_scales = hidden, None, None
    if fp8_scales is not None:
        a, a_scale = per_token_group_quant_fp8(hidden)
        up_scales = (a_scale, fp8_scales[0])
    # With tma_down, the gate/up output in the aligned order: a row per slot, padding included.
    act_rows = aligned[1].shape[0] * up_config.block_m if tma_down else num_pairs
    act = torch.empty(act_rows, inter, dtype=hidden.dtype, device=device)
    if tma_up:  # never a one-token step
        from kvik.triton_kernels.fused_moe_tma import moe_gate_up_tma

        moe_gate_up_tma(a, w13, act, aligned, top_k, up_config, up_scales, out_by_slot=tma_down)
    else:
        grouped_gemm(
            a, w13, act, aligned, None, top_k, True, up_config, up_scales, top_k=top_k,
            one_token=one_token, zero_counters=None if sum_last is None else sum_last.counters,
            out_by_slot=tma_down,
        )  # fmt: skip
    if aligned is not None and down_config.block_m != up_config.block_m:
        aligned = align_to_blocks(ids, experts, down_config.block_m, counts)
    if fp8_scales is not None:
        act, act_scale = per_token_group_quant_fp8(act)
        down_scales = (act_scale, fp8_scales[1])
    out = torch.empty(num_pairs, size, dtype=hidden.dtype, device=device)
    if tma_down:  # both GEMMs at one block_m: the alignment above is the gate/up GEMM's
        from kvik.triton_kernels.fused_moe_tma import moe_down_tma

        moe_down_tma(act, w2, out, aligned, weights, down_config, down_scales)
    else:
        grouped_gemm(
            act, w2, out, aligned, weights, 1, False, down_config, down_scales, top_k=top_k,
            one_token=one_token, sum_last=sum_last,
        )  # fmt: skip
    if sum_last is not None:
        return sum_last.out
    if top_k == 1:
        return out
    return moe_sum(out, tokens, top_k)


def fused_moe(
    hidden: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w2: Tensor,
    top_k: int,
    renormalize: bool,
    configs: tuple[MoeConfig, MoeConfig] | None = None,
) -> Tensor:
    """``kvik.ops.fused_moe`` on the GPU (or the CPU under the interpreter): hidden [T, H],
    router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]. ``configs`` overrides the
    registered (gate/up, down) launch configurations (the tuning script's sweeps)."""
    from kvik.triton_kernels.attention import device_arch

    check_fused_moe_shapes(hidden, router_logits, w13, w2, top_k)
    tokens, size = hidden.shape
    experts, inter = w13.shape[0], w2.shape[2]
    if tokens == 0:
        return torch.empty_like(hidden)
    if configs is None:
        arch = device_arch(hidden.device)[0]
        configs = moe_configs(arch, tokens, experts, inter, size, top_k, hidden.dtype)
    return _experts(
        hidden.contiguous(), router_logits, w13.contiguous(), w2.contiguous(), top_k,
        renormalize, configs,
    )  # fmt: skip


def fused_moe_fp8_block(
    hidden: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    top_k: int,
    renormalize: bool,
    configs: tuple[MoeConfig, MoeConfig] | None = None,
) -> Tensor:
    """``kvik::fused_moe_fp8_block`` (reference: kvik.quantization.fp8_moe): block-FP8 experts,
    the hidden states and then the gated activations quantized per token in groups of 128
    (kvik.triton_kernels.fp8_quant) before each grouped GEMM. The launches, like the
    unquantized op's, depend on the token count alone (graph-safe)."""
    from kvik.quantization.fp8_moe import check_fp8_block_moe_shapes
    from kvik.triton_kernels.attention import device_arch

    check_fp8_block_moe_shapes(hidden, router_logits, w13, w13_scale, w2, w2_scale, top_k)
    tokens, size = hidden.shape
    experts, inter = w13.shape[0], w2.shape[2]
    if tokens == 0:
        return torch.empty_like(hidden)
    if configs is None:
        arch = device_arch(hidden.device)[0]
        configs = moe_configs(arch, tokens, experts, inter, size, top_k, w13.dtype)
    for config in configs:
        if 128 % config.block_k:
            raise ValueError(
                f"block-FP8 experts need a BLOCK_K that divides 128 (one scale group a step), "
                f"got {config}"
            )
    return _experts(
        hidden.contiguous(), router_logits, w13.contiguous(), w2.contiguous(), top_k,
        renormalize, configs, (w13_scale.contiguous(), w2_scale.contiguous()),
    )  # fmt: skip
