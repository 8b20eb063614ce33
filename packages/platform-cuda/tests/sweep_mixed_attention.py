"""Attention launch configurations for prefill and mixed steps on the GPU (run by hand there; not a
test). Workload C (1000 x (1024 in, 128 out)) spends its time in two kinds of step: prompts only
(8 prompts of 1024 tokens, 8192 batched tokens) and mixed (~500 decodes at ~1100 tokens of context
beside 7 prompts of 1024). On the H200 a mixed step of Qwen3-30B-A3B spent 27.9 of its 113 ms of
kernels in attention (docs/benchmarks.md, the eighteenth session), where reading the decodes' K/V
once and the prompts' causal products at the bf16 peak take ~16 ms.

For each head layout (Qwen3-30B-A3B: 32 query heads over 4 KV heads; Llama-3.1-8B: 32 over 8;
head size 128, bf16, 16-token blocks in a permuted table) and each step kind, every (block_m,
tile_n, num_warps, num_stages) that compiles is timed (CUDA-graph replays of one launch, median)
and checked against the configuration the platform uses now; the floor printed beside each is the
larger of the K/V bytes at 4.28 TB/s and the causal FLOP at 790 TFLOP/s.

    python packages/platform-cuda/tests/sweep_mixed_attention.py [--quick] [--full-step STEP ...]

``--quick`` sweeps block_m and tile_n only (4 warps, 3 stages); ``--full-step`` names the steps
("prompts only", "mixed", "one long prompt") that still take every warp and stage count. The configurations are
timed as one launch over the whole step; mixed steps are also timed as the backend now runs them
(``kvik.triton_kernels.attention.MIN_DECODES_APART``): the leading decodes through the decode-only
variant with split-KV, then the prompts, a change made before it was timed, which this measures.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from kvik.triton_kernels.attention import device_arch
from kvik.triton_kernels.paged_attention import AttentionConfig, num_kv_splits, paged_attention
from kvik_cuda.tuning import attention_config

HEAD_SIZE, BLOCK = 128, 16
LAYOUTS = {"qwen3-30b-a3b": (32, 4), "llama-3.1-8b": (32, 8)}  # query heads, KV heads
#: (decodes, their context, prompts, prompt length): workload C's two kinds of step.
STEPS = {
    "prompts only": (0, 0, 8, 1024),
    "mixed": (500, 1100, 7, 1024),
    "one long prompt": (0, 0, 1, 8192),  # not C's: checks the prompt tiling at longer rows
    # issue 13's serving run (16 req/s of 1024-token prompts): ~40 decodes beside one new prompt
    "serving mixed": (40, 1152, 1, 1024),
    "one prompt": (0, 0, 1, 1024),
}
PEAK_BYTES, PEAK_FLOPS = 4.28e12, 790e12


def step_inputs(heads: int, kv_heads: int, decodes: int, context: int, prompts: int, length: int):
    """Queries of the step's tokens (decodes first, as the runner lays them out), a K/V cache
    holding every request's keys in a permuted block table, sequence lengths and query starts."""
    dev = torch.device("cuda")
    seq_lens = [context + 1] * decodes + [length] * prompts
    query_lens = [1] * decodes + [length] * prompts
    blocks = [-(-n // BLOCK) for n in seq_lens]
    width = max(blocks)
    order = torch.randperm(sum(blocks), device=dev).int()
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=dev)
    at = 0
    for row, n in enumerate(blocks):
        table[row, :n] = order[at : at + n]
        at += n
    cache = torch.randn(
        2, sum(blocks), BLOCK, kv_heads, HEAD_SIZE, dtype=torch.bfloat16, device=dev
    )
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=dev)
    q = torch.randn(sum(query_lens), heads, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return q, cache, table, lens, starts, max(query_lens)


def floor_seconds(heads: int, kv_heads: int, decodes: int, context: int, prompts: int, n: int):
    kv_bytes = 2 * kv_heads * HEAD_SIZE * 2 * (decodes * (context + 1) + prompts * n)
    flops = 4 * HEAD_SIZE * heads * (decodes * (context + 1) + prompts * n * (n + 1) / 2)
    return max(kv_bytes / PEAK_BYTES, flops / PEAK_FLOPS), kv_bytes, flops


def sweep(name: str, heads: int, kv_heads: int, step: str, quick: bool, arch: str) -> None:
    shape = STEPS[step]
    q, cache, table, lens, starts, max_query_len = step_inputs(heads, kv_heads, *shape)
    out = torch.empty_like(q)
    group = heads // kv_heads
    now = attention_config(arch, HEAD_SIZE, group, max_query_len, torch.bfloat16)
    floor, kv_bytes, flops = floor_seconds(heads, kv_heads, *shape)

    def run(config: AttentionConfig) -> None:
        paged_attention(
            q, cache[0], cache[1], out, starts, lens, table, HEAD_SIZE**-0.5, None, config
        )

    def timed(config: AttentionConfig) -> float:
        run(config)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(config)
        return triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")

    reference_ms = timed(now)
    reference = out.clone()
    warps_stages = [(4, 3)] if quick else list(itertools.product((4, 8), (2, 3, 4)))
    results = {}
    for block_m, tile_n in itertools.product((64, 128), (32, 64, 128)):
        for warps, stages in warps_stages:
            config = AttentionConfig(
                max(block_m, triton.next_power_of_2(group)), tile_n, warps, stages
            )
            try:
                ms = timed(config)
            except Exception:  # out of shared memory or registers
                continue
            err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            assert err < 1e-2, (config, err)
            results[config] = ms
    split_line = ""
    if shape[0] and shape[2]:
        split_ms = timed_split_launch(q, cache, table, lens, starts, shape[0], group, now, arch)
        split_line = (
            f"; decodes and prompts as two launches: {split_ms * 1e3:.0f} us "
            f"({floor * 1e3 / split_ms:.0%})"
        )
    print(
        f"{name}, {step} ({shape[0]} decodes at {shape[1]}, {shape[2]} prompts of {shape[3]}): "
        f"floor {floor * 1e6:.0f} us ({kv_bytes / 1e9:.2f} GB of K/V, {flops / 1e12:.2f} TFLOP); "
        f"now {now}: {reference_ms * 1e3:.0f} us ({floor * 1e3 / reference_ms:.0%} of the floor)"
        + split_line
    )
    for config in sorted(results, key=results.get)[:4]:
        ms = results[config]
        print(f"    {config}: {ms * 1e3:.0f} us ({floor * 1e3 / ms:.0%})")


def timed_split_launch(q, cache, table, lens, starts, decodes, group, prompt_config, arch):
    """The step as two launches: its leading decodes through the decode-only variant (16-row
    programs, split-KV as the backend picks it for max_model_len 4096), then its prompts with
    ``prompt_config``; checked against the one launch first. ms a step."""
    _, num_sms = device_arch(q.device)
    decode_config = attention_config(arch, HEAD_SIZE, group, 1, torch.bfloat16)
    splits = num_kv_splits(decodes, cache.shape[3], 4096, num_sms)
    prompt_starts = starts[decodes:] - decodes
    out = torch.empty_like(q)
    scale = HEAD_SIZE**-0.5

    def run() -> None:
        paged_attention(
            q[:decodes], cache[0], cache[1], out[:decodes], starts[: decodes + 1],
            lens[:decodes], table[:decodes], scale, None, decode_config, splits,
        )  # fmt: skip
        paged_attention(
            q[decodes:], cache[0], cache[1], out[decodes:], prompt_starts, lens[decodes:],
            table[decodes:], scale, None, prompt_config,
        )  # fmt: skip

    run()
    one = torch.empty_like(q)
    paged_attention(q, cache[0], cache[1], one, starts, lens, table, scale, None, prompt_config)
    err = ((out.float() - one.float()).norm() / one.float().norm()).item()
    assert err < 1e-2, err
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full-step", action="append", default=[], choices=sorted(STEPS))
    parser.add_argument(
        "--step",
        action="append",
        default=[],
        choices=sorted(STEPS),
        help="sweep only these steps (default: all)",
    )
    parser.add_argument("--layout", action="append", default=[], choices=sorted(LAYOUTS))
    args = parser.parse_args()
    arch, _ = device_arch(torch.device("cuda"))
    for name, (heads, kv_heads) in LAYOUTS.items():
        if args.layout and name not in args.layout:
            continue
        for step in args.step or STEPS:
            sweep(name, heads, kv_heads, step, args.quick and step not in args.full_step, arch)


if __name__ == "__main__":
    main()
