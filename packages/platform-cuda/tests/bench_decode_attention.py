"""Decode attention bandwidth on the GPU (run by hand there; not a test): batch 64, 32 query
heads over 8 KV heads of 128, 4096-token contexts in 16-token blocks, a permuted block table, bf16
queries over a bf16 KV cache, then over an FP8 (e4m3) one (``--kv-cache-dtype fp8``).

Floor: every request's K and V read once, 64 * 4096 * 8 * 128 * 2 B * 2 = 1.07 GB in bf16 (half
that in FP8), at PEAK_BYTES_PER_S (the H200's device-to-device copy bandwidth, as
docs/benchmarks.md records it).
"""

from __future__ import annotations

import sys

import torch
import triton

from kvik.triton_kernels.attention import device_arch
from kvik.triton_kernels.paged_attention import num_kv_splits, paged_attention
from kvik_cuda.tuning import attention_config

BATCH, HEADS, KV_HEADS, HEAD_SIZE, CONTEXT, BLOCK = 64, 32, 8, 128, 4096, 16
PEAK_BYTES_PER_S = 4.28e12


def main() -> None:
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        bench(cache_dtype)


def bench(cache_dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    blocks_per_req = CONTEXT // BLOCK
    num_blocks = BATCH * blocks_per_req
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, device=dev).to(cache_dtype)
    # An FP8 cache's per-layer scales, as device tensors (the values do not change the speed).
    k_scale, v_scale = (torch.tensor(s, device=dev) for s in (0.5, 0.25))
    block_table = torch.randperm(num_blocks, device=dev).view(BATCH, blocks_per_req).int()
    seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(BATCH + 1, dtype=torch.int32, device=dev)
    q = torch.randn(BATCH, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    arch, num_sms = device_arch(dev)
    config = attention_config(arch, HEAD_SIZE, HEADS // KV_HEADS, 1, cache_dtype)
    chosen = num_kv_splits(BATCH, KV_HEADS, CONTEXT, num_sms)
    nbytes = 2 * BATCH * CONTEXT * KV_HEADS * HEAD_SIZE * cache.element_size()
    print(f"{cache_dtype} cache: {arch}, {num_sms} SMs, {config}, heuristic splits {chosen}")
    print(f"{'splits':>6} {'us':>8} {'TB/s':>6} {'of 4.28':>7}")
    reference = None
    for splits in sorted({1, 2, 4, 8, chosen}):

        def run(splits: int = splits) -> None:
            paged_attention(
                q, cache[0], cache[1], out, query_start_loc, seq_lens, block_table,
                HEAD_SIZE**-0.5, None, config, splits, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip

        run()
        if reference is None:
            reference = out.clone()
        err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
        tbps = nbytes / (ms * 1e-3) / 1e12
        print(f"{splits:>6} {ms * 1e3:>8.1f} {tbps:>6.2f} {tbps * 1e12 / PEAK_BYTES_PER_S:>7.1%}"
              f"  (vs splits=1: {err:.1e})")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
