"""Attention launch configurations where a head's row is wider than 256 bytes (run by hand on the
GPU; not a test): bf16 heads of 256 (Gemma) and fp32 heads of 128 and 256 (the GPU tests' fp32
models, fp32 serving). For each (dtype, head size, query heads per KV head), 4 prompts of 1024
tokens and 64 decodes at 1152 tokens, each candidate (block_m, tile_n, num_warps, num_stages)
timed as a CUDA graph of 32 launches, with the registers and spill bytes the compiler gave it
(sm_90's ptxas puts some fp32 variants in 32 registers with kilobytes of spills, 5-10x slower)
and the largest difference from the first candidate's output. The first candidate of each list
is what ``kvik_cuda.tuning.attention_config`` picks now (given the queries' dtype). ``--kv-fp8``:
fp32 queries of 128 over an e4m3 cache instead, prompts and decodes, where the 16-bit queries'
tiles fell into the fallback and ``FP32_OVER_E4M3`` now decides.

    python packages/platform-cuda/tests/sweep_wide_attention.py [--groups 1,2] [--fp32-only | --kv-fp8]
"""

from __future__ import annotations

import sys

import torch
from sweep_decode_attention import graph_time  # this folder is the script's sys.path[0]

from kvik.triton_kernels import paged_attention as kernels
from kvik.triton_kernels.attention import device_arch
from kvik.triton_kernels.paged_attention import AttentionConfig, block_rows, paged_attention
from kvik_cuda.tuning import attention_config

BLOCK, KV_HEADS = 16, 4
PROMPTS, PROMPT_LEN = 4, 1024
DECODES, CONTEXT = 64, 1152
PROMPT_CANDIDATES = [(32, 4, 2), (32, 8, 2), (16, 4, 2), (16, 8, 2), (64, 8, 2), (32, 8, 3)]
DECODE_CANDIDATES = [(32, 4, 2), (32, 2, 2), (16, 4, 2), (64, 4, 2), (32, 8, 2), (32, 4, 3)]
E4M3 = torch.float8_e4m3fn


def last_compiled_usage() -> tuple[object, object]:
    """Registers a thread and spill bytes of the attention kernel compiled last."""
    compiled = list(kernels._launch_attention._compiled.values())[-1][0]
    return getattr(compiled, "n_regs", "?"), getattr(compiled, "n_spills", "?")


def inputs(
    dtype: torch.dtype,
    head: int,
    group: int,
    requests: int,
    tokens: int,
    context: int,
    kv_fp8: bool,
):
    """Queries, a permuted paged cache (e4m3 where ``kv_fp8``) and the per-request tables for
    ``requests`` of ``tokens`` new tokens each over ``context`` cached ones."""
    dev = torch.device("cuda")
    blocks = context // BLOCK
    query = torch.randn(requests * tokens, KV_HEADS * group, head, device=dev, dtype=dtype)
    cache = torch.randn(2, requests * blocks, BLOCK, KV_HEADS, head, device=dev, dtype=dtype)
    cache = cache.to(E4M3) if kv_fp8 else cache
    table = torch.randperm(requests * blocks, device=dev, dtype=torch.int32).view(requests, -1)
    seq_lens = torch.full((requests,), context, device=dev, dtype=torch.int32)
    starts = torch.arange(0, requests * tokens + 1, tokens, device=dev, dtype=torch.int32)
    return query, cache, table, seq_lens, starts


def sweep(
    arch: str, dtype: torch.dtype, head: int, group: int, decode: bool, kv_fp8: bool = False
) -> None:
    requests, tokens, context = (
        (DECODES, 1, CONTEXT) if decode else (PROMPTS, PROMPT_LEN, PROMPT_LEN)
    )
    query, cache, table, seq_lens, starts = inputs(
        dtype, head, group, requests, tokens, context, kv_fp8
    )
    block_m = block_rows(group, tokens)
    now = attention_config(arch, head, group, tokens, cache.dtype, query_dtype=dtype)
    one = torch.ones((), dtype=torch.float32, device=query.device)
    scales = {"k_scale": one, "v_scale": one} if kv_fp8 else {}
    candidates = [now] + [
        AttentionConfig(block_m, *c)
        for c in (DECODE_CANDIDATES if decode else PROMPT_CANDIDATES)
        if AttentionConfig(block_m, *c) != now
    ]
    kv_bytes = cache.numel() * cache.element_size()
    first = None
    for config in candidates:
        out = torch.empty_like(query)

        def run(out=out, config=config):
            paged_attention(
                query, cache[0], cache[1], out, starts, seq_lens, table, head**-0.5, None, config,
                **scales,
            )  # fmt: skip

        kernels._launch_attention._compiled.clear()
        try:
            ms = graph_time(run)
        except Exception as error:  # a candidate past the shared memory: report, go on
            print(f"  {config}: failed: {repr(error)[:160]}", flush=True)
            continue
        first = out.clone() if first is None else first
        shape = f"{requests} decodes at {context}" if decode else f"{requests} prompts of {tokens}"
        rate = f", {kv_bytes / (ms * 1e-3) / 1e12:.2f} TB/s of cache" if decode else ""
        mark = "  <- now" if config == now else ""
        cache_label = " e4m3 cache" if kv_fp8 else ""
        print(
            f"{str(dtype)[6:]} head {head} group {group}{cache_label} {shape} {config}:"
            f" {ms * 1e3:.1f} us{rate},"
            f" regs/spills {last_compiled_usage()}, max|diff| {(out - first).abs().max().item():.1e}"
            f"{mark}",
            flush=True,
        )


def main() -> None:
    arch, _ = device_arch(torch.device("cuda"))
    groups = [1, 2]
    if "--groups" in sys.argv:
        groups = [int(g) for g in sys.argv[sys.argv.index("--groups") + 1].split(",")]
    shapes = [(torch.float32, 128), (torch.float32, 256)]
    if "--fp32-only" not in sys.argv:
        shapes.insert(0, (torch.bfloat16, 256))
    print(torch.cuda.get_device_name(), arch, flush=True)
    if "--kv-fp8" in sys.argv:
        for group in groups:
            for decode in (False, True):
                sweep(arch, torch.float32, 128, group, decode, kv_fp8=True)
        return
    for dtype, head in shapes:
        for group in groups:
            for decode in (False, True):
                sweep(arch, dtype, head, group, decode)


if __name__ == "__main__":
    main()
