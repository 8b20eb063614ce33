"""The fused MoE op's small launches on a CUDA GPU, each on its own (CUDA-graph replays,
``triton.testing.do_bench_cudagraph``), at Qwen3-30B-A3B's shapes (2048 columns, 128 experts,
top 8):

    python bench/moe_small_kernels_gpu.py [--tokens 64,256,4096,8192] [--json FILE]

- the top-k sum (``kvik.triton_kernels.fused_moe.moe_sum``: each thread adds its columns row by
  row) beside the form it replaced (the [top_k, block] tile loaded at once and reduced along
  its rows with ``tl.sum``, defined here as ``sum_rows_at_once_kernel``), PyTorch's reduction
  over the [tokens, top_k, N] view and a copy of the same bytes (a floor); each checked against
  an fp32 sum first;
- routing alone (``route``: 8 or 32 tokens a program) beside one token a program (its form to
  a428624: the same kernel launched with ROWS=1), and the op's launches above 16 tokens:
  routing with its partial counts, alignment and scatter (``route_and_count`` then
  ``align_to_blocks``, 16 rows a block), beside the form to a428624 (routing one token a
  program, then one program histogramming every pair: ``align_by_histogram_kernel``, defined
  here); each alignment checked against the other first.

Microseconds a call go to stdout and, as JSON, to $OUT/moe_small_kernels_gpu.json where OUT is
set and to --json. Needs kvik (core) and a CUDA GPU; no platform package.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from kvik.triton_kernels.fused_moe import (
    ALIGN_BLOCKS_CHUNK,
    ALIGN_WARPS,
    ROUTING_WARPS,
    SCATTER_BLOCK,
    SCATTER_WARPS,
    _store_block_experts_and_padding,
    _store_expert_runs,
    align_to_blocks,
    max_row_blocks,
    moe_routing_kernel,
    moe_scatter_kernel,
    moe_sum,
    route,
    route_and_count,
)

HIDDEN, EXPERTS, TOP_K = 2048, 128, 8


@triton.jit
def sum_rows_at_once_kernel(
    pairs_ptr, out_ptr, N, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_N: tl.constexpr
):
    """moe_sum_kernel's first form (to 1532a85): one token's [TOP_K_PAD, BLOCK_N] rows loaded
    at once and reduced along axis 0."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, TOP_K_PAD)
    rows = token * TOP_K + ks
    mask = (ks[:, None] < TOP_K) & (cols[None, :] < N)
    x = tl.load(pairs_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(x.to(tl.float32), axis=0)
    tl.store(out_ptr + token * N + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)


def sum_rows_at_once(pairs: torch.Tensor, tokens: int) -> torch.Tensor:
    out = torch.empty(tokens, HIDDEN, dtype=pairs.dtype, device=pairs.device)
    sum_rows_at_once_kernel[(tokens, triton.cdiv(HIDDEN, 256))](
        pairs, out, HIDDEN, TOP_K=TOP_K, TOP_K_PAD=TOP_K, BLOCK_N=256, num_warps=4
    )
    return out


@triton.jit
def align_by_histogram_kernel(
    ids_ptr, cursor_ptr, block_expert_ptr, total_ptr, sorted_ptr, num_pairs, num_experts,
    max_blocks, BLOCK_M: tl.constexpr, E_BINS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCKS_CHUNK: tl.constexpr,
):  # fmt: skip
    """moe_align_kernel's form to a428624: one program histograms every pair's expert."""
    counts = tl.zeros([E_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
        counts += tl.histogram(expert, E_BINS, mask=offs < num_pairs)
    ends, total = _store_expert_runs(
        counts, tl.arange(0, E_BINS), num_experts, cursor_ptr, total_ptr, BLOCK_M
    )
    _store_block_experts_and_padding(
        ends, total, block_expert_ptr, sorted_ptr, num_pairs, max_blocks, BLOCK_M, BLOCKS_CHUNK
    )


def route_one_token_a_program(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.shape[0]
    weights = torch.empty(tokens, TOP_K, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, TOP_K, dtype=torch.int32, device=logits.device)
    moe_routing_kernel[(tokens,)](
        logits, weights, ids, ids, tokens, EXPERTS, logits.stride(0), TOP_K=TOP_K,
        TOP_K_PAD=TOP_K, E_PAD=EXPERTS, RENORMALIZE=True, ROWS=1, COUNT=False,
        num_warps=ROUTING_WARPS,
    )  # fmt: skip
    return weights, ids


def route_align_before(logits: torch.Tensor, block_m: int = 16):
    """The op's launches above 16 tokens to a428624."""
    _, ids = route_one_token_a_program(logits)
    num_pairs = ids.numel()
    blocks = max_row_blocks(num_pairs, EXPERTS, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(EXPERTS, dtype=torch.int32, device=ids.device)
    align_by_histogram_kernel[(1,)](
        ids, cursor, block_expert, total, sorted_pairs, num_pairs, EXPERTS, blocks,
        BLOCK_M=block_m, E_BINS=EXPERTS, CHUNK=1024, BLOCKS_CHUNK=ALIGN_BLOCKS_CHUNK,
        num_warps=ALIGN_WARPS,
    )  # fmt: skip
    moe_scatter_kernel[(triton.cdiv(num_pairs, SCATTER_BLOCK),)](
        ids, cursor, sorted_pairs, num_pairs, BLOCK=SCATTER_BLOCK, num_warps=SCATTER_WARPS
    )
    return ids, (sorted_pairs, block_expert, total)


def route_align_now(logits: torch.Tensor, block_m: int = 16):
    """The op's launches above 16 tokens now."""
    _, ids, counts = route_and_count(logits, TOP_K, True)
    return ids, align_to_blocks(ids, EXPERTS, block_m, counts)


def runs(ids: torch.Tensor, aligned, block_m: int = 16) -> dict[int, list[int]]:
    """Each expert's pairs, from an alignment's blocks in use (the order in a run is free)."""
    sorted_pairs, block_expert, total = (t.cpu() for t in aligned)
    found: dict[int, list[int]] = {}
    for b in range(int(total) // block_m):
        rows = sorted_pairs[b * block_m : (b + 1) * block_m]
        found.setdefault(int(block_expert[b]), []).extend(rows[rows < ids.numel()].tolist())
    return {expert: sorted(pairs) for expert, pairs in found.items()}


def microseconds(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50) * 1e3


def measure(tokens: int) -> dict[str, float]:
    pairs = torch.randn(tokens * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
    expected = pairs.float().view(tokens, TOP_K, HIDDEN).sum(1)
    sums = {
        "moe_sum": lambda: moe_sum(pairs, tokens, TOP_K),
        "sum_rows_at_once": lambda: sum_rows_at_once(pairs, tokens),
        "torch_view_sum": lambda: pairs.view(tokens, TOP_K, HIDDEN).sum(1),
    }
    record: dict[str, float] = {}
    for name, fn in sums.items():
        error = float((fn().float() - expected).abs().max() / expected.abs().max())
        if error > 1e-2:
            raise AssertionError(f"{name} at {tokens} tokens: relative error {error:.2e}")
        record[name] = microseconds(fn)
    record["copy_of_the_pairs"] = microseconds(pairs.clone)
    logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16)
    ids_before, aligned_before = route_align_before(logits)
    ids_now, aligned_now = route_align_now(logits)
    if not torch.equal(ids_before, ids_now) or runs(ids_now, aligned_now) != runs(
        ids_before, aligned_before
    ):
        raise AssertionError(f"the alignments at {tokens} tokens differ")
    record["route"] = microseconds(lambda: route(logits, TOP_K, True))
    record["route_one_token_a_program"] = microseconds(lambda: route_one_token_a_program(logits))
    record["route_align_scatter"] = microseconds(lambda: route_align_now(logits))
    record["route_align_scatter_before"] = microseconds(lambda: route_align_before(logits))
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="64,256,4096,8192")
    parser.add_argument("--json", help="also write the records here")
    args = parser.parse_args()
    torch.manual_seed(0)
    records = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        records[tokens] = measure(tokens)
        for name, us in records[tokens].items():
            print(f"{tokens:6d} tokens  {name:28s} {us:8.2f} us", flush=True)
    text = json.dumps({"device": torch.cuda.get_device_name(), "us": records}, indent=1)
    for target in filter(None, [args.json, os.environ.get("OUT")]):
        path = Path(target)
        (path / "moe_small_kernels_gpu.json" if path.is_dir() else path).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
