"""The fused MoE op's small launches on a CUDA GPU, each on its own (CUDA-graph replays,
``triton.testing.do_bench_cudagraph``), at Qwen3-30B-A3B's shapes (2048 columns, 128 experts,
top 8):

    python bench/moe_small_kernels_gpu.py [--tokens 64,256] [--json FILE]

- the top-k sum (``kvik.triton_kernels.fused_moe.moe_sum``: each thread adds its columns row by
  row) beside the form it replaced (the [top_k, block] tile loaded at once and reduced along
  its rows with ``tl.sum``, defined here as ``sum_rows_at_once_kernel``), PyTorch's reduction
  over the [tokens, top_k, N] view and a copy of the same bytes (a floor); each checked against
  an fp32 sum first;
- routing alone (``route``) and routing with the alignment and scatter (``align_to_blocks``, 16
  rows a block) that the op launches above 16 tokens.

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

from kvik.triton_kernels.fused_moe import align_to_blocks, moe_sum, route

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
    record["route"] = microseconds(lambda: route(logits, TOP_K, True))
    record["route_align_scatter"] = microseconds(
        lambda: align_to_blocks(route(logits, TOP_K, True)[1], EXPERTS, 16)
    )
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="64,256")
    parser.add_argument("--json", help="also write the records here")
    args = parser.parse_args()
    torch.manual_seed(0)
    records = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        records[tokens] = measure(tokens)
        for name, us in records[tokens].items():
            print(f"{tokens:6d} tokens  {name:22s} {us:8.2f} us", flush=True)
    text = json.dumps({"device": torch.cuda.get_device_name(), "us": records}, indent=1)
    for target in filter(None, [args.json, os.environ.get("OUT")]):
        path = Path(target)
        (path / "moe_small_kernels_gpu.json" if path.is_dir() else path).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
