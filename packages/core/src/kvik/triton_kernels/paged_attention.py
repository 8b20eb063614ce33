"""Paged attention for mixed batches: prefill chunks, prefix-hit chunks and decodes in one launch.

A program owns ``BLOCK_Q`` consecutive query tokens of one request and every query head of one KV
head's group, padded to a power of two: ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows (row m is token
m // GROUP_PAD, head m % GROUP_PAD of the group), so each key/value tile read from the paged cache
serves the whole group. Keys are walked in tiles of ``TILE_N`` positions, each looked up through the
block table, with an online softmax in fp32 (exp2, scale folded in). The causal and sliding-window
masks come from positions: request r's query token j sits at ``seq_len - query_len + j``.

Split-KV (flash-decoding): with ``NUM_SPLITS > 1`` the grid gains a third axis and each program walks
one segment of the key tiles, leaving its unnormalised accumulator, running max and sum in fp32
scratch; ``reduce_splits_kernel`` merges the segments. It pays for long decode contexts, where a
batch has too few (request, KV head) programs to fill the GPU.

A key tile's positions are looked up in the block table one key at a time, unless the cache's
blocks hold whole tiles (``ONE_BLOCK_A_TILE``: BLOCK_SIZE a multiple of TILE_N, as with
``--block-size 64`` and 32-key tiles): then a tile is one table entry and slots at a fixed
offset within its block, and only the block's base address changes from tile to tile. On the
H100 at 64-slot blocks: 2-3% off a decode layer over an e4m3 cache, 1-2% over bf16
(docs/benchmarks.md).

A cache slot holds every KV head's key side by side, so a (request, KV head) program reads a
piece of each slot's row (128 bytes of an e4m3 cache's 1 KB at Llama-3.1-8B's heads). Decode-only
launches therefore put the KV heads on the grid's first axis: a request's programs are adjacent
and in flight together, and read the rest of the same rows at about the same time. On the H100,
batch 256 at 640-token contexts over an e4m3 cache: 126.7 -> 123.0 µs a layer; bf16 and the other
shapes measured level or up to 2% faster (docs/benchmarks.md). Prefill and mixed launches keep
query blocks first: the grid's second axis stops at 65,535 programs.

An FP8 cache (``KV_FP8``, kvik.attention.kv_quant) is read as e4m3 and widened to the queries' dtype
(exactly: every e4m3 value is a bf16, fp16 and fp32 value) for the same products; its per-layer
scales are never multiplied into a tile: the key scale joins the softmax scale, the value scale the
final normalisation. They are read through pointers (device tensors, as a captured graph needs).

The values' product reduces over keys, but a cache row holds one key's head dimension, so each
tensor-core operand needs bytes of different rows side by side; there is no 8-bit transposing
``ldmatrix``, so read as bytes the e4m3 values left shared memory a byte at a time (sm90 SASS:
128 ``LDS.U8`` a thread per 64-key tile). ``V_PAIRS`` (decodes' programs) reads them two a 16-bit
word instead: word j of a key holds its dimensions 2j and 2j + 1, so the tile is transposed by the
16-bit ``ldmatrix``, and the even and odd bytes widen into two products of half the head's width
(``acc``, ``acc_odd``), interleaved once at the end. On the H200 at batch 256 over 640-token
contexts: 110.0 -> 105.6 µs a layer (docs/benchmarks.md). On NVIDIA GPUs of sm_89 and later the
bytes widen in PTX (``PAIR_ASM``, ``_pair_bytes_to_f16``): another 2-4% a layer on the H200.

The launch configuration (tile sizes, warps, stages) is each platform's choice for its architectures
(``kvik_cuda.tuning``, ``kvik_rocm.tuning``), passed in as an ``AttentionConfig``. The PyTorch
reference is the CPU backend's SDPA (``kvik_cpu.attention``), which the tests compare against
through the same ``AttentionMetadata``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.fp8_quant import (
    GROUP_SIZE,
    dynamic_scale,
    quantize_for_cast,
    rounds_in_software,
)
from kvik.triton_kernels.kv_cache import kv_scale_pointers
from kvik.triton_kernels.launch import FastLauncher
from kvik.triton_kernels.pdl import cuda_capability, uses_pdl, wait_for_prior_kernel

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    # The last request r whose first q block (query_start_loc[r] // BLOCK_Q + r) is <= q_block.
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _pair_bytes_to_f16(words, selector: tl.constexpr):
    """fp16 of one byte of each 16-bit word (``selector``: "0x0020" the low bytes, "0x0031" the
    high ones), in PTX: a pair of words is one 32-bit register, one ``prmt`` gathers the two
    bytes and one ``cvt`` widens them, where Triton's integer ops took about three instructions
    a pair. Element-wise for any pairing of the words, so Triton still moves the layout change
    for the product above it (the tile is transposed as 16-bit words). NVIDIA, sm_89 and later."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $1, 0, " + selector + "; "
        "mov.b32 {lo, hi}, t; cvt.rn.f16x2.e4m3x2 $0, lo; }",
        "=r,r",
        [words],
        dtype=tl.float16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _attend_tile(
    acc,
    acc_odd,
    row_max,
    row_sum,
    q,
    tile,
    n,
    d,
    d_valid,
    q_pos,
    seq_len,
    bt_row,
    k_head_ptr,
    v_head_ptr,
    k_stride_blk,
    k_stride_slot,
    v_stride_blk,
    v_stride_slot,
    v_stride_d,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_PAIRS: tl.constexpr,
    PAIR_ASM: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is in the sequence and seen by every row
    ONE_BLOCK_A_TILE: tl.constexpr,  # BLOCK_SIZE % TILE_N == 0 (module doc)
):
    """One tile of keys into the online softmax: the updated (acc, acc_odd, row_max, row_sum)."""
    k_pos = tile * TILE_N + n  # [TILE_N]
    if MASKED:
        k_valid = k_pos < seq_len
        kv_mask = k_valid[None, :] & d_valid[:, None]
    else:
        kv_mask = d_valid[:, None] & (n < TILE_N)[None, :]
    if ONE_BLOCK_A_TILE:
        # The tile's keys are consecutive slots of one block: one table entry (the tile's first
        # key is in the sequence, so its entry is too), and the slots' offsets are the same for
        # every tile, so only the block's base address changes from tile to tile.
        first = tile * TILE_N
        block_base = tl.load(bt_row + first // BLOCK_SIZE).to(tl.int64)
        slot_in_block = first % BLOCK_SIZE + n
        k_ptrs = (k_head_ptr + block_base * k_stride_blk) + slot_in_block[None, :] * k_stride_slot
        v_ptrs = (v_head_ptr + block_base * v_stride_blk) + slot_in_block[:, None] * v_stride_slot
    else:
        slot_in_block = k_pos % BLOCK_SIZE
        if MASKED:
            block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_head_ptr + block[None, :] * k_stride_blk + slot_in_block[None, :] * k_stride_slot
        v_ptrs = v_head_ptr + block[:, None] * v_stride_blk + slot_in_block[:, None] * v_stride_slot
    if MASKED or HEAD_PAD != HEAD_SIZE:
        k = tl.load(k_ptrs + d[:, None], mask=kv_mask, other=0.0)  # [HEAD_PAD, TILE_N]
    else:
        k = tl.load(k_ptrs + d[:, None])
    if V_PAIRS:
        # Two e4m3 values of a key as one 16-bit word: [TILE_N, HEAD_PAD // 2] (module doc).
        pairs = tl.arange(0, HEAD_PAD // 2)
        pair_ptrs = v_ptrs.to(tl.pointer_type(tl.int16)) + pairs[None, :]
        if MASKED or HEAD_PAD != HEAD_SIZE:
            pair_mask = (pairs < HEAD_SIZE // 2)[None, :]
            if MASKED:
                pair_mask = pair_mask & k_valid[:, None]
            words = tl.load(pair_ptrs, mask=pair_mask, other=0).to(tl.uint16, bitcast=True)
        else:
            words = tl.load(pair_ptrs).to(tl.uint16, bitcast=True)
        if q.dtype == tl.float16 and PAIR_ASM:
            v = _pair_bytes_to_f16(words, "0x0020")
            v_odd = _pair_bytes_to_f16(words, "0x0031")
        else:
            v = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(q.dtype)
            v_odd = (words >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(q.dtype)
    else:
        if MASKED or HEAD_PAD != HEAD_SIZE:
            v = tl.load(v_ptrs + d[None, :] * v_stride_d, mask=tl.trans(kv_mask), other=0.0)
        else:
            v = tl.load(v_ptrs + d[None, :] * v_stride_d)  # [TILE_N, HEAD_PAD]
        if KV_FP8:
            v = v.to(q.dtype)
    if KV_FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, k, input_precision="ieee") * scale_log2  # [BLOCK_M, TILE_N], log2 units
    if MASKED:
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed &= k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW
        s = tl.where(allowed, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        # A row with nothing allowed yet keeps max -inf; subtract 0 there so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:  # every score is finite, so the new maximum is too
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        safe_max = new_max
    p = tl.exp2(s - safe_max[:, None])
    alpha = tl.exp2(row_max - safe_max)
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    if V_PAIRS:
        acc_odd = acc_odd * alpha[:, None] + tl.dot(p.to(v.dtype), v_odd, input_precision="ieee")
    return acc, acc_odd, new_max, row_sum


# num_reqs changes from step to step: unspecialised, so a new batch size never compiles a variant.
# The request metadata's pointers are not specialised on 16-byte alignment either: a mixed step
# whose leading decodes attend apart passes them sliced at its number of decodes, and on the H200
# a count not a multiple of 4 compiled a second variant in a timed run (664 ms, workload B's
# first mixed step; docs/benchmarks.md). They are read a few scalars at a time.
# counter_ptr too: a launch without the in-kernel merge passes seq_lens (maybe sliced) there.
@triton.jit(
    # os_stride_g is the step's row count (the scales are tokens-contiguous): specialised, its
    # being 1 or a multiple of 16 would compile variants mid-serving.
    do_not_specialize=["num_reqs", "os_stride_g"],
    do_not_specialize_on_alignment=[
        "counter_ptr", "query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr",
        "row_request_ptr",
    ],
)  # fmt: skip
def paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hk, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hk, D]
    out_ptr,  # [T, H, D]: the queries' dtype, or e4m3 where QUANTIZE_OUT
    out_scale_ptr,  # [T, H * D / 128] fp32 (QUANTIZE_OUT only)
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_PAD] fp32 (split-KV only)
    part_max_ptr,  # [T, H, NUM_SPLITS] fp32 (split-KV only)
    part_sum_ptr,  # [T, H, NUM_SPLITS] fp32 (split-KV only)
    counter_ptr,  # [R * Hk] int32, zero on entry and left zero (REDUCE_LAST only)
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    block_table_ptr,  # [R, max_blocks]
    row_request_ptr,  # [T] int32: each token row's request (ROW_REQUESTS only)
    k_scale_ptr,  # [] fp32 (KV_FP8 only)
    v_scale_ptr,  # [] fp32 (KV_FP8 only)
    num_reqs,
    scale_log2,  # softmax scale * log2(e)
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    os_stride_t,  # out_scale_ptr's strides (QUANTIZE_OUT only)
    os_stride_g,
    k_stride_blk,
    k_stride_slot,
    k_stride_h,
    v_stride_blk,
    v_stride_slot,
    v_stride_h,
    v_stride_d,  # the values' head-dimension stride (1 in kvik's caches; a view may differ)
    bt_stride,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,  # one query token per request: program r is request r's
    # With DECODE_ONLY: each token row is its own decode (seq_lens per row, [T]), reading its
    # request's keys (block_table[row_request[row]]): a verification's rows computed as decodes.
    ROW_REQUESTS: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds e4m3 keys / k_scale and values / v_scale
    # With NUM_SPLITS > 1 and DECODE_ONLY: the last segment of a (request, KV head) to finish
    # merges the segments itself (counted in counter_ptr), so no reduction launch follows.
    REDUCE_LAST: tl.constexpr = False,
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
    # KV_FP8 with the values' head dimension contiguous: values read two a 16-bit word, the even
    # and the odd dimensions multiplied apart (module doc).
    V_PAIRS: tl.constexpr = False,
    PAIR_ASM: tl.constexpr = False,  # V_PAIRS: the bytes widened by PTX (_pair_bytes_to_f16)
    # The output written as o_proj's block-FP8 input (kvik.quantization.activation): each head's
    # result rounded to the queries' dtype, then quantized per group of 128 (HEAD_SIZE a multiple
    # of 128, a power of two), e4m3 values to out_ptr and fp32 scales to out_scale_ptr.
    QUANTIZE_OUT: tl.constexpr = False,
    ROUND_IN_SOFTWARE: tl.constexpr = False,  # QUANTIZE_OUT: kvik.triton_kernels.fp8_quant
    # BLOCK_SIZE % TILE_N == 0: a key tile lies in one cache block (module doc).
    ONE_BLOCK_A_TILE: tl.constexpr = False,
):
    wait_for_prior_kernel(PDL)
    if DECODE_ONLY:
        # A request's KV heads are adjacent programs (the grid's first axis), so the programs in
        # flight read the same cache slots (one slot holds every KV head's key) at about the
        # same time (module doc).
        kv_head = tl.program_id(0)
        q_block = tl.program_id(1)
    else:
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        # Token r is request r's only one: no search, and no programs beyond the batch.
        req = q_block
        q_first = q_block
        q_len = 1
        q_start = 0
    else:
        req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
        if req < 0:
            return  # before the first request's rows (its tokens start past row 0)
        q_first = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_first
        q_start = (q_block - (q_first // BLOCK_Q + req)) * BLOCK_Q  # within the request
        if q_start >= q_len:
            return  # the grid is sized for the worst case
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    token_in_req = q_start + m // GROUP_PAD  # [BLOCK_M]
    head = kv_head * GROUP + m % GROUP_PAD
    row_valid = (token_in_req < q_len) & (m % GROUP_PAD < GROUP)
    token = (q_first + token_in_req).to(tl.int64)
    q_pos = context_len + token_in_req
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_SIZE
    q = tl.load(
        q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_PAD]
    if KV_FP8:
        # q . (k * k_scale) = (q . k) * k_scale: the key scale joins the softmax scale.
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        if q_ptr.dtype.element_ty == tl.bfloat16:
            # e4m3 widens to fp16 in one instruction a pair; to bf16 it takes one more an element
            # on Hopper. So bf16 queries take the fp16 products instead, pre-scaled (in log2
            # units, ~0.13x the raw values) so that fp16's range holds them; e4m3 keys and values
            # are exact in fp16, and its 10-bit mantissa rounds the queries finer than bf16's.
            q = (q.to(tl.float32) * scale_log2).to(tl.float16)
            scale_log2 = 1.0

    # Keys this program can see: up to its last query position, from the window's start.
    kv_end = tl.minimum(seq_len, context_len + q_start + BLOCK_Q)
    first_tile = 0
    if SLIDING_WINDOW > 0:
        first_tile = tl.maximum(context_len + q_start - SLIDING_WINDOW + 1, 0) // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    if V_PAIRS:
        acc = tl.zeros([BLOCK_M, HEAD_PAD // 2], tl.float32)  # the even dimensions
        acc_odd = tl.zeros([BLOCK_M, HEAD_PAD // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        acc_odd = tl.zeros([BLOCK_M, 1], tl.float32)  # unused
    n = tl.arange(0, TILE_N)
    table_req = req
    if ROW_REQUESTS:
        table_req = tl.load(row_request_ptr + q_block)
    bt_row = block_table_ptr + table_req.to(tl.int64) * bt_stride
    k_head_ptr = k_cache_ptr + kv_head * k_stride_h
    v_head_ptr = v_cache_ptr + kv_head * v_stride_h
    # A prompt chunk's tiles that every row sees whole (their last key at or before the program's
    # first query position, so within the sequence) need no mask: walked first, without the
    # masks' loads and selects (on the H200, 8 prompts of 1024 tokens 11% faster). Decodes keep
    # one masked loop: their reads bound them, and the second loop's pipeline cost them 1-8%.
    unmasked_hi = tile_lo
    if SLIDING_WINDOW == 0 and (not DECODE_ONLY):
        full_end = (context_len + q_start + 1) // TILE_N
        unmasked_hi = tl.minimum(tl.maximum(full_end, tile_lo), tile_hi)
        for tile in range(tile_lo, unmasked_hi):
            acc, acc_odd, row_max, row_sum = _attend_tile(
                acc, acc_odd, row_max, row_sum, q, tile, n, d, d_valid, q_pos, seq_len, bt_row,
                k_head_ptr, v_head_ptr, k_stride_blk, k_stride_slot, v_stride_blk, v_stride_slot,
                v_stride_d, scale_log2, BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, SLIDING_WINDOW,
                KV_FP8, V_PAIRS, PAIR_ASM, False, ONE_BLOCK_A_TILE,
            )  # fmt: skip
    for tile in range(unmasked_hi, tile_hi):
        acc, acc_odd, row_max, row_sum = _attend_tile(
            acc, acc_odd, row_max, row_sum, q, tile, n, d, d_valid, q_pos, seq_len, bt_row,
            k_head_ptr, v_head_ptr, k_stride_blk, k_stride_slot, v_stride_blk, v_stride_slot,
            v_stride_d, scale_log2, BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, SLIDING_WINDOW, KV_FP8,
            V_PAIRS, PAIR_ASM, True, ONE_BLOCK_A_TILE,
        )  # fmt: skip
    if V_PAIRS:  # dimension 2j from acc[:, j], 2j + 1 from acc_odd[:, j]
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, HEAD_PAD])
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)  # sum_j p_j (v_j * v_scale), before any normalisation

    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        _store_rows(
            out, out_ptr, out_scale_ptr, q_ptr, token, head, row_valid, d, d_valid, o_stride_t,
            o_stride_h, os_stride_t, os_stride_g, BLOCK_M, HEAD_PAD, QUANTIZE_OUT,
            ROUND_IN_SOFTWARE,
        )  # fmt: skip
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_max_ptr + part, row_max, mask=row_valid)
        tl.store(part_sum_ptr + part, row_sum, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=row_valid[:, None])
        if REDUCE_LAST:
            # Every thread's partial results are written before one thread announces them
            # (release); the last segment reads the others' only after its atomic saw them all.
            tl.debug_barrier()
            counter = counter_ptr + q_block * (NUM_HEADS // GROUP) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                out = _merge_segments(
                    part_acc_ptr, part_max_ptr, part_sum_ptr, token, head, row_valid, d,
                    NUM_HEADS, NUM_SPLITS, HEAD_PAD, BLOCK_M,
                )  # fmt: skip
                _store_rows(
                    out, out_ptr, out_scale_ptr, q_ptr, token, head, row_valid, d, d_valid,
                    o_stride_t, o_stride_h, os_stride_t, os_stride_g, BLOCK_M, HEAD_PAD,
                    QUANTIZE_OUT, ROUND_IN_SOFTWARE,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)  # ready for the next launch


@triton.jit
def _store_rows(
    out, out_ptr, out_scale_ptr, q_ptr, token, head, row_valid, d, d_valid, o_stride_t, o_stride_h,
    os_stride_t, os_stride_g, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr,
    QUANTIZE_OUT: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr,
):  # fmt: skip
    """A program's normalised rows (fp32 [BLOCK_M, HEAD_PAD]) written to the output: in its dtype,
    or (QUANTIZE_OUT) rounded to the queries' dtype, as the unquantized output holds them, and
    quantized per group of 128 as ``per_token_group_quant_kernel`` quantizes that output, so the
    e4m3 values and scales are the ones o_proj's own quantization would have made."""
    out_ptrs = out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    mask = row_valid[:, None] & d_valid[None, :]
    if QUANTIZE_OUT:
        rounded = out.to(q_ptr.dtype.element_ty).to(tl.float32)
        if HEAD_PAD >= 128:  # each head is HEAD_PAD / 128 whole groups
            GROUPS: tl.constexpr = HEAD_PAD // 128
            groups = tl.reshape(rounded, [BLOCK_M, GROUPS, 128])
            scale = dynamic_scale(tl.max(tl.abs(groups), axis=2))  # [BLOCK_M, GROUPS]
            values = quantize_for_cast(groups, scale[:, :, None], ROUND_IN_SOFTWARE)
            tl.store(
                out_ptrs, tl.reshape(values, [BLOCK_M, HEAD_PAD]).to(out_ptr.dtype.element_ty),
                mask=mask,
            )  # fmt: skip
            group = head[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]  # within the row
            scale_ptrs = out_scale_ptr + token[:, None] * os_stride_t + group * os_stride_g
            tl.store(scale_ptrs, scale, mask=row_valid[:, None])
        else:
            # Heads of 64: a group is a token's heads 2j and 2j + 1, which are rows m and m + 1 of
            # the program (its group of query heads is even, so pairs never straddle tokens,
            # programs or validity): consecutive rows, one group a pair.
            PAIRS: tl.constexpr = BLOCK_M // 2
            groups = tl.reshape(rounded, [PAIRS, 128])
            scale = dynamic_scale(tl.max(tl.abs(groups), axis=1))  # [PAIRS]
            values = quantize_for_cast(groups, scale[:, None], ROUND_IN_SOFTWARE)
            tl.store(
                out_ptrs, tl.reshape(values, [BLOCK_M, HEAD_PAD]).to(out_ptr.dtype.element_ty),
                mask=mask,
            )  # fmt: skip
            pair_token = tl.max(tl.reshape(token, [PAIRS, 2]), axis=1)  # both rows' token
            pair_group = tl.min(tl.reshape(head, [PAIRS, 2]), axis=1) // 2
            pair_valid = tl.max(tl.reshape(row_valid.to(tl.int32), [PAIRS, 2]), axis=1) > 0
            scale_ptrs = out_scale_ptr + pair_token * os_stride_t + pair_group * os_stride_g
            tl.store(scale_ptrs, scale, mask=pair_valid)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_segments(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    token,
    head,
    row_valid,
    d,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """A program's rows from every segment's partial results, merged as ``reduce_splits_kernel``
    merges them (one segment at a time here, an online maximum): the normalised rows, fp32."""
    first = (token * NUM_HEADS + head) * NUM_SPLITS  # [BLOCK_M]
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for seg in range(0, NUM_SPLITS):
        # Past L1 (".cg"): the other segments were written by other multiprocessors.
        seg_max = tl.load(
            part_max_ptr + first + seg, mask=row_valid, other=float("-inf"), cache_modifier=".cg"
        )
        seg_sum = tl.load(
            part_sum_ptr + first + seg, mask=row_valid, other=0.0, cache_modifier=".cg"
        )
        seg_acc = tl.load(
            part_acc_ptr + (first + seg)[:, None] * HEAD_PAD + d[None, :],
            mask=row_valid[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        new_max = tl.maximum(row_max, seg_max)
        # Segments without keys have max -inf: subtract 0 there, so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        old_weight = tl.exp2(row_max - safe_max)
        seg_weight = tl.exp2(seg_max - safe_max)
        row_sum = row_sum * old_weight + seg_sum * seg_weight
        acc = acc * old_weight[:, None] + seg_acc * seg_weight[:, None]
        row_max = new_max
    return acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]


@triton.jit
def reduce_splits_kernel(
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_PAD] fp32
    part_max_ptr,  # [T, H, NUM_SPLITS] fp32, log2 units
    part_sum_ptr,  # [T, H, NUM_SPLITS] fp32
    o_stride_t,
    o_stride_h,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS padded to a power of two (tl.arange's length)
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seg = tl.arange(0, SPLITS_PAD)
    seg_valid = seg < NUM_SPLITS
    part = (token * NUM_HEADS + head) * NUM_SPLITS + seg  # [SPLITS_PAD]
    # Padding segments read as empty ones: max -inf, weight 0.
    seg_max = tl.load(part_max_ptr + part, mask=seg_valid, other=float("-inf"))
    seg_sum = tl.load(part_sum_ptr + part, mask=seg_valid, other=0.0)
    d = tl.arange(0, HEAD_PAD)
    seg_acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], mask=seg_valid[:, None], other=0.0
    )
    # Empty segments have max -inf and weight 0; at least one segment holds a key.
    weight = tl.exp2(seg_max - tl.max(seg_max, axis=0))
    out = tl.sum(seg_acc * weight[:, None], axis=0) / tl.sum(seg_sum * weight, axis=0)
    tl.store(
        out_ptr + token * o_stride_t + head * o_stride_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_SIZE,
    )


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # query rows per program: BLOCK_Q tokens x GROUP_PAD heads
    tile_n: int  # keys per step of the inner loop
    num_warps: int
    num_stages: int


def block_rows(group: int, max_query_len: int) -> int:
    """BLOCK_M, the query rows of a program, as the platforms' launch configurations choose it:
    the smallest tile ``tl.dot`` allows (16 rows) where a step's queries fit (decodes), else 64
    (what Hopper's wgmma wants per warpgroup), and never fewer than the group's padded heads."""
    group_pad = triton.next_power_of_2(group)
    rows = 16 if max_query_len <= 16 // min(group_pad, 16) else 64
    return max(rows, group_pad)


def interpreter_config(
    arch: str, head_size: int, group: int, max_query_len: int, dtype: torch.dtype
) -> AttentionConfig:
    """The configuration under ``TRITON_INTERPRET=1`` on the CPU: no hardware to tune for, so the
    narrowest key tile. The GPU platforms register theirs (``attention.register_attention_configs``)."""
    return AttentionConfig(block_rows(group, max_query_len), 16, 1, 1)


MAX_KV_SPLITS = 16


def num_kv_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Segments per (request, KV head) for a decode-only batch: enough programs for two waves,
    each segment at least 128 keys of ``max_seq_len``, a power of two up to 16. The engine passes
    max_model_len as ``max_seq_len``, so the choice depends on the batch size alone. (On the H200,
    Llama-8B heads at batch 1, 16 splits beat 8 at contexts 640 and 4096 alike, 6.8 against 7.9
    and 11.8 against 17.1 µs, where segments of at least 512 keys had capped max_model_len 4096
    at 8: docs/benchmarks.md.)"""
    programs = num_reqs * num_kv_heads
    splits = 1
    while (
        splits < MAX_KV_SPLITS and programs * splits < 2 * num_sms and max_seq_len >= 256 * splits
    ):
        splits *= 2
    return splits


@functools.cache
def attention_constexprs(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    config: AttentionConfig,
    sliding_window: int | None,
    num_splits: int,
    decode_only: bool = False,
    kv_fp8: bool = False,
    row_requests: bool = False,
    pdl: bool = False,
    reduce_last: bool = False,
    pair_asm: bool = False,
    quantize_out: bool = False,
    round_in_software: bool = False,
) -> dict[str, int]:
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    return {
        "NUM_HEADS": num_heads,
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "HEAD_SIZE": head_size,
        "HEAD_PAD": triton.next_power_of_2(head_size),
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": config.block_m // group_pad,
        "BLOCK_M": config.block_m,
        "TILE_N": config.tile_n,
        "SLIDING_WINDOW": sliding_window or 0,
        "NUM_SPLITS": num_splits,
        "DECODE_ONLY": decode_only,
        "ROW_REQUESTS": row_requests,
        "KV_FP8": kv_fp8,
        "REDUCE_LAST": reduce_last,
        "PDL": pdl,
        # Decodes' 16-row programs only (each half of the head a product of at least 16 columns,
        # tl.dot's least): prompt chunks' 64-row programs ran 4-5% slower with pairs on the H200.
        "V_PAIRS": kv_fp8 and head_size % 2 == 0 and head_size >= 32 and config.block_m < 64,
        "PAIR_ASM": pair_asm,
        "QUANTIZE_OUT": quantize_out,
        # Only quantizing launches read it: the others keep one variant.
        "ROUND_IN_SOFTWARE": quantize_out and round_in_software,
        "ONE_BLOCK_A_TILE": block_size % config.tile_n == 0,
    }


@functools.cache
def _reduce_constexprs(attention: tuple) -> dict[str, int]:
    return reduce_constexprs(dict(attention))


# Launched once or twice a layer from Python in every step that is not one captured graph.
_launch_attention = FastLauncher(paged_attention_kernel)
_launch_reduce = FastLauncher(reduce_splits_kernel)


def reduce_constexprs(attention: dict[str, int]) -> dict[str, int]:
    """The reduction's constexprs from the attention kernel's (the partial results are fp32 and
    already carry the value scale, so an FP8 cache changes nothing here)."""
    constexprs = {
        k: attention[k] for k in ("NUM_HEADS", "HEAD_SIZE", "HEAD_PAD", "NUM_SPLITS", "PDL")
    }
    constexprs["SPLITS_PAD"] = triton.next_power_of_2(constexprs["NUM_SPLITS"])
    return constexprs


REDUCE_WARPS = 4


def quantizes_output_in_kernel(head_size: int, group: int, merged_in_launch: bool) -> bool:
    """Whether a launch can write its output as block-FP8 activations (``paged_attention``'s
    ``output_scales``): each head whole groups of 128 with no padding (a head size of a power of
    two and a multiple of 128), or heads of 64 two a group (an even ``group`` of query heads a KV
    head, so that a program holds both heads of each group); and every row written by the
    attention launch itself (one segment, or split-KV segments merged in the launch; not a
    reduction launch after it)."""
    whole = head_size % GROUP_SIZE == 0 and head_size & (head_size - 1) == 0
    paired = head_size * 2 == GROUP_SIZE and group % 2 == 0
    return (whole or paired) and merged_in_launch


def widens_e4m3_pairs_in_ptx(device: torch.device) -> bool:
    """Whether ``_pair_bytes_to_f16``'s PTX runs on ``device``: an NVIDIA GPU of sm_89 or later
    (``cvt.rn.f16x2.e4m3x2``), not the interpreter (which runs no assembly)."""
    if device.type != "cuda" or torch.version.hip is not None or _INTERPRET:
        return False
    return cuda_capability(device.index) >= (8, 9)


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    output: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    scale: float,
    sliding_window: int | None,
    config: AttentionConfig,
    num_splits: int = 1,
    part_acc: Tensor | None = None,
    part_max: Tensor | None = None,
    part_sum: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    row_requests: Tensor | None = None,
    split_counters: Tensor | None = None,
    output_scales: Tensor | None = None,
) -> None:
    """query/output [T, H, D] (last dim contiguous); key/value_cache [num_blocks, block, Hk, D];
    query_start_loc [R + 1], seq_lens [R], block_table [R, max_blocks] int32; the requests'
    tokens may start past row 0 of ``query`` (query_start_loc[0] > 0: the tail of a step whose
    leading requests another launch takes), the rows before them untouched. With
    ``row_requests`` [T] int32, every token row is a decode of its own: ``seq_lens`` is then per
    row [T] (its position + 1) and its keys are its request's, ``block_table[row_requests[t]]``
    (a speculative verification's rows, computed exactly as decode rows are). With
    ``num_splits > 1``, the fp32 scratch ``part_acc [T, H, S, HEAD_PAD]``, ``part_max`` and
    ``part_sum [T, H, S]`` may be given (persistent buffers, as a captured graph needs); else it
    is allocated. An FP8 cache (float8_e4m3fn) needs ``k_scale`` and ``v_scale``, fp32 scalars
    on the device. ``split_counters`` (int32 zeros, at least T * Hk of them, left zero; a
    persistent buffer as a captured graph needs) lets a decode-only launch's last segment of
    each (request, KV head) merge the segments itself instead of a reduction launch. With
    ``output_scales`` (fp32 [T, H * D / 128], any strides), ``output`` is float8_e4m3fn and gets
    the result quantized per group of 128 as o_proj's block-FP8 input
    (``quantizes_output_in_kernel`` says which launches can)."""
    t, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_reqs = seq_lens.shape[0]
    # One token per request (every decode step, padded graphs included), or per-row decodes:
    # the decode variant.
    decode_only = t == num_reqs
    fp8, k_scale, v_scale = kv_scale_pointers(key_cache, k_scale, v_scale)
    reduce_last = num_splits > 1 and decode_only and split_counters is not None
    quantize_out = output_scales is not None
    group = num_heads // num_kv_heads
    merged = num_splits == 1 or reduce_last
    if quantize_out and not quantizes_output_in_kernel(head_size, group, merged):
        raise ValueError(
            f"attention quantizes its output in the kernel for head sizes of a power of two and a "
            f"multiple of {GROUP_SIZE}, or of {GROUP_SIZE // 2} in even groups of query heads, "
            f"without a reduction launch; not head size {head_size} in groups of {group} with "
            f"{num_splits} splits{'' if merged else ' merged by a reduction launch'}"
        )
    constexprs = attention_constexprs(
        num_heads, num_kv_heads, head_size, block_size, config, sliding_window, num_splits,
        decode_only, fp8, row_requests is not None, uses_pdl(query.device), reduce_last,
        fp8 and widens_e4m3_pairs_in_ptx(query.device), quantize_out,
        quantize_out and rounds_in_software(query.device),
    )  # fmt: skip
    head_pad, block_q = constexprs["HEAD_PAD"], constexprs["BLOCK_Q"]
    if t == 0:
        return
    # Each stride() call is host time, paid per launch (a PIECEWISE step launches from Python).
    q_strides, o_strides, k_strides = query.stride(), output.stride(), key_cache.stride()
    os_strides = output_scales.stride() if quantize_out else (0, 0)
    v_strides = value_cache.stride()
    if constexprs["V_PAIRS"] and v_strides[-1] != 1:
        constexprs = {**constexprs, "V_PAIRS": False}  # a view whose pairs are not adjacent
    assert q_strides[-1] == 1 and o_strides[-1] == 1 and k_strides[-1] == 1
    if num_splits > 1:
        if part_acc is None:
            f32 = {"dtype": torch.float32, "device": query.device}
            part_acc = torch.empty(t, num_heads, num_splits, head_pad, **f32)
            part_max = torch.empty(t, num_heads, num_splits, **f32)
            part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = output  # unused
    if decode_only:  # a request's KV heads side by side (the kernel's DECODE_ONLY)
        grid = (num_kv_heads, num_reqs, num_splits)
    else:  # query blocks on the first axis, which takes more than the second's 65,535
        grid = (t // block_q + num_reqs, num_kv_heads, num_splits)
    _launch_attention(
        grid,
        (
            query, key_cache, value_cache, output,
            output_scales if quantize_out else output, part_acc, part_max, part_sum,
            split_counters if reduce_last else seq_lens, query_start_loc, seq_lens, block_table,
            seq_lens if row_requests is None else row_requests, k_scale, v_scale, num_reqs,
            scale * LOG2E, q_strides[0], q_strides[1], o_strides[0], o_strides[1], *os_strides,
            *k_strides[:3], *v_strides, block_table.stride(0),
        ),
        constexprs, num_warps=config.num_warps, num_stages=config.num_stages,
        launch_pdl=constexprs["PDL"],
    )  # fmt: skip
    if num_splits > 1 and not reduce_last:
        _launch_reduce(
            (t, num_heads), (output, part_acc, part_max, part_sum, o_strides[0], o_strides[1]),
            _reduce_constexprs(tuple(constexprs.items())), num_warps=REDUCE_WARPS,
            launch_pdl=constexprs["PDL"],
        )  # fmt: skip
