"""Greedy ids: the index of each row's largest value (the first on ties, as ``torch.max(dim)``
gives it), optionally mapped through an id table (an EAGLE-3 head's draft ids to the target's).

PyTorch's reduction gives a row to one block, so a single row costs its latency rather than its
bytes: 10.7 µs for an EAGLE-3 head's 32k-entry row, ~27 µs for Llama-3's 128k one on the H200
(docs/benchmarks.md). Here a row is cut into chunks of ``CHUNK`` entries, one program each
(``argmax_chunks_kernel``: the chunk's largest value and its first index, in fp32 scratch), then
one program a row merges the chunks and maps the id (``argmax_merge_kernel``): two launches,
no atomics, the same result on every run. NaN ranks as +inf (torch ranks it above every number;
the two differ only for a row holding both NaN and +inf).

Reference: ``kvik.ops.argmax_rows``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.launch import FastLauncher

#: Entries a chunk program reads: a 128k-entry row spreads over 63 programs, a 32k one over 16.
CHUNK = 2048
#: Entries a chunk program loads per loop step.
BLOCK = 1024
CHUNK_WARPS = 4
MERGE_WARPS = 1
INT32_MAX = 2**31 - 1


@triton.jit
def argmax_chunks_kernel(
    x_ptr,  # [R, V]: rows of values, the last dim contiguous
    part_val_ptr,  # [R, NUM_CHUNKS] fp32
    part_idx_ptr,  # [R, NUM_CHUNKS] int32
    vocab,
    x_stride,
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    start = chunk * CHUNK
    # Each lane keeps its largest value and, since its indices only grow, their first index.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = start + lanes
    for offset in range(0, CHUNK, BLOCK):
        idx = start + offset + lanes
        x = tl.load(x_ptr + row * x_stride + idx, mask=idx < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        take = x > best
        best = tl.where(take, x, best)
        best_idx = tl.where(take, idx, best_idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    tl.store(part_val_ptr + row * NUM_CHUNKS + chunk, top)
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, first)


@triton.jit
def argmax_merge_kernel(
    part_val_ptr,  # [R, NUM_CHUNKS] fp32
    part_idx_ptr,  # [R, NUM_CHUNKS] int32
    index_map_ptr,  # [V] int64 (HAS_MAP only)
    out_ptr,  # [R] int64
    out_stride,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    valid = c < NUM_CHUNKS
    vals = tl.load(part_val_ptr + row * NUM_CHUNKS + c, mask=valid, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + row * NUM_CHUNKS + c, mask=valid, other=2147483647)
    top = tl.max(vals, axis=0)
    # Chunks come in index order, so the smallest index among the maximal chunks is the first.
    first = tl.min(tl.where(vals == top, idxs, 2147483647), axis=0)
    result = first.to(tl.int64)
    if HAS_MAP:
        result = tl.load(index_map_ptr + result)
    tl.store(out_ptr + row * out_stride, result)


def argmax_rows(logits: Tensor, index_map: Tensor | None, out: Tensor) -> None:
    """``out[r] = index_map[argmax(logits[r])]`` (without a map, the argmax itself), logits
    [R, V] of any float dtype, out [R] int64 (may be a strided view)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    if vocab == 0:
        raise ValueError("argmax over rows of no entries")
    if vocab > INT32_MAX:
        raise ValueError(f"argmax over rows of {vocab} entries: more than int32 indexes")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    # Both launched from Python every step (sampling is not captured).
    _launch_chunks(
        (num_chunks, rows),
        (logits, part_val, part_idx, vocab, logits.stride(0)),
        _chunks_constexprs(num_chunks),
        num_warps=CHUNK_WARPS,
    )
    _launch_merge(
        (rows,),
        (part_val, part_idx, out if index_map is None else index_map, out, out.stride(0)),
        _merge_constexprs(num_chunks, index_map is not None),
        num_warps=MERGE_WARPS,
    )


@functools.cache
def _chunks_constexprs(num_chunks: int) -> dict:
    return {"NUM_CHUNKS": num_chunks, "CHUNK": CHUNK, "BLOCK": BLOCK}


@functools.cache
def _merge_constexprs(num_chunks: int, has_map: bool) -> dict:
    return {
        "NUM_CHUNKS": num_chunks,
        "CHUNKS_PAD": triton.next_power_of_2(num_chunks),
        "HAS_MAP": has_map,
    }


_launch_chunks = FastLauncher(argmax_chunks_kernel)
_launch_merge = FastLauncher(argmax_merge_kernel)
