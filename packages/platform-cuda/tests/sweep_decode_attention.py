"""Decode attention launch configurations on the GPU (run by hand there; not a test): for a few
(batch, context) shapes of Llama-3.1-8B's attention (32 query heads over 8 KV heads of 128, bf16,
16-token blocks in a permuted table), the time and bandwidth of each (tile_n, num_warps,
num_stages) at the split count the backend would choose, against the configuration it uses now;
then, with ``--splits``, the split-KV counts instead (1 to 16, the reduction included) at small
batches, each timed as a CUDA graph of 32 launches (as a decode step replays them: without the
host's launch time), against the count ``num_kv_splits`` picks for max_model_len 4096 and 131072.
``--joint`` times every (configuration, split count) pair at the serving run's decode batches
(24 to 64 requests at 1152 tokens) and around them (8 to 256), where the grid's few waves decide more than the tile does.
``--kv-fp8`` runs either sweep on an FP8 (e4m3) cache, as ``--kv-cache-dtype fp8`` stores it: half
the bytes to read, so the bandwidth figures count one byte an element.

    python packages/platform-cuda/tests/sweep_decode_attention.py [--splits | --joint] [--kv-fp8]
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import torch
import triton
from torch import Tensor

from kvik.triton_kernels.attention import device_arch
from kvik.triton_kernels.paged_attention import AttentionConfig, num_kv_splits, paged_attention
from kvik_cuda.tuning import attention_config, decode_plan

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
CASES = [(256, 640), (256, 1152), (1, 640)]  # (batch, context)
PEAK = 4.28e12
MAX_MODEL_LEN = 131072


#: (batch, context) of the split sweep: batch-1 and small decode batches, and the ~40 requests at
#: ~1152 tokens that issue 13's serving run (16 req/s of 1024 in, 256 out) decodes at.
SPLIT_CASES = [
    (1, 640), (1, 4096), (4, 640), (16, 640), (64, 640),
    (24, 1152), (32, 1152), (40, 1152), (48, 1152), (64, 1152), (96, 1152), (128, 1152),
]  # fmt: skip


#: The cache's dtype (``--kv-fp8``: e4m3) and the scales an FP8 cache is read with.
KV_FP8 = "--kv-fp8" in sys.argv[1:]


def engine_launch(batch: int, arch: str, num_sms: int) -> tuple[AttentionConfig, int]:
    """What the engine launches for ``batch`` decodes over this sweep's cache: kvik_cuda's
    measured plan where it has one (``decode_plan``), else the default tiling and split count."""
    dtype = torch.float8_e4m3fn if KV_FP8 else torch.bfloat16
    group = HEADS // KV_HEADS
    plan = decode_plan(arch, HEAD_SIZE, group, dtype, batch * KV_HEADS, num_sms)
    if plan is not None:
        return plan
    config = attention_config(arch, HEAD_SIZE, group, 1, dtype)
    return config, num_kv_splits(batch, KV_HEADS, MAX_MODEL_LEN, num_sms)


def main() -> None:
    arch, num_sms = device_arch(torch.device("cuda"))
    print(f"cache: {'fp8 (e4m3)' if KV_FP8 else 'bf16'}")
    if "--joint" in sys.argv[1:]:
        for batch in JOINT_BATCHES:
            joint_sweep(batch, 1152, arch, num_sms)
        return
    if "--splits" in sys.argv[1:]:
        for batch, context in SPLIT_CASES:
            split_sweep(batch, context, arch, num_sms)
        return
    for batch, context in CASES:
        sweep(batch, context, arch, num_sms)


def kv_bytes(batch: int, context: int) -> int:
    """The bytes of K and V a decode step's attention reads."""
    return 2 * batch * context * KV_HEADS * HEAD_SIZE * (1 if KV_FP8 else 2)


def kv_scales() -> dict[str, Tensor]:
    """``paged_attention``'s scale arguments for the sweep's cache (none for bf16)."""
    if not KV_FP8:
        return {}
    one = torch.ones((), dtype=torch.float32, device="cuda")
    return {"k_scale": one, "v_scale": one}


def decode_inputs(batch: int, context: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A decode step's attention inputs: queries, a K/V cache of ``context`` tokens a request in a
    permuted block table, sequence lengths and query starts."""
    dev = torch.device("cuda")
    blocks_per_req = -(-context // BLOCK)
    num_blocks = batch * blocks_per_req
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    if KV_FP8:
        cache = cache.to(torch.float8_e4m3fn)
    table = torch.randperm(num_blocks, device=dev).view(batch, blocks_per_req).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    return q, cache, table, seq_lens, starts


def split_sweep(batch: int, context: int, arch: str, num_sms: int) -> None:
    """µs a launch (with its reduction) at each split count, under a CUDA graph."""
    q, cache, table, seq_lens, starts = decode_inputs(batch, context)
    config = attention_config(arch, HEAD_SIZE, HEADS // KV_HEADS, 1, torch.bfloat16)
    nbytes = kv_bytes(batch, context)
    picks = {n: num_kv_splits(batch, KV_HEADS, n, num_sms) for n in (4096, MAX_MODEL_LEN)}
    reference, line = None, []
    for splits in (1, 2, 4, 8, 16):
        out = torch.empty_like(q)

        def run(splits: int = splits, out: Tensor = out) -> None:
            paged_attention(
                q, cache[0], cache[1], out, starts, seq_lens, table, HEAD_SIZE**-0.5, None,
                config, splits, **kv_scales(),
            )  # fmt: skip

        run()  # compiles, and allocates nothing inside the capture below but the scratch
        if reference is None:
            reference = out.clone()
        err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        assert err < 1e-2, (splits, err)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(32):
                run()
        ms = triton.testing.do_bench(graph.replay, warmup=5, rep=50, return_mode="median") / 32
        line.append(f"{splits}: {ms * 1e3:.1f} us ({nbytes / (ms * 1e-3) / PEAK:.0%})")
    print(f"batch {batch}, context {context} (num_kv_splits picks {picks[4096]} at max_model_len "
          f"4096, {picks[MAX_MODEL_LEN]} at {MAX_MODEL_LEN}): " + ", ".join(line))  # fmt: skip


#: Decode batches of the joint sweep (at 1152 tokens a request).
JOINT_BATCHES = (8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 256)


def graph_time(run) -> float:
    """ms a launch of ``run`` (attention and reduction), replayed as a CUDA graph of 32."""
    run()  # compiles, and allocates nothing inside the capture below but the scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(32):
            run()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=50, return_mode="median") / 32


def joint_sweep(batch: int, context: int, arch: str, num_sms: int) -> None:
    """Every (tile_n, warps, stages) with 1 to 4 splits at one decode batch: the five fastest
    against the configuration and split count the backend picks now."""
    q, cache, table, seq_lens, starts = decode_inputs(batch, context)
    nbytes = kv_bytes(batch, context)
    now, now_splits = engine_launch(batch, arch, num_sms)
    results, reference = {}, None
    for tile_n, warps, stages, splits in itertools.product(
        (32, 64), (2, 4), (2, 3, 4), (1, 2, 3, 4)
    ):
        config = AttentionConfig(16, tile_n, warps, stages)
        out = torch.empty_like(q)

        def run(config: AttentionConfig = config, splits: int = splits, out: Tensor = out) -> None:
            paged_attention(
                q, cache[0], cache[1], out, starts, seq_lens, table, HEAD_SIZE**-0.5, None,
                config, splits, **kv_scales(),
            )  # fmt: skip

        try:
            ms = graph_time(run)
        except Exception:  # out of shared memory or registers
            continue
        if reference is None:
            reference = out.clone()
        err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        assert err < 1e-2, (config, splits, err)
        results[(config, splits)] = ms

    def line(key) -> str:
        ms = results.get(key, float("nan"))
        return f"{key[0]} splits {key[1]}: {ms * 1e3:.1f} us ({nbytes / (ms * 1e-3) / PEAK:.0%})"

    print(f"batch {batch}, context {context}: now {line((now, now_splits))}")
    for key in sorted(results, key=results.get)[:5]:
        print(f"   {line(key)}")
    # The whole table, for rules that pick the configuration and the split count together.
    table = sorted(results.items(), key=lambda item: (*dataclasses.astuple(item[0][0]), item[0][1]))
    cells = [f"{c.tile_n}/{c.num_warps}/{c.num_stages} s{s} {ms * 1e3:.1f}" for (c, s), ms in table]
    print("   all (tile_n/warps/stages splits us): " + "; ".join(cells))


def sweep(batch: int, context: int, arch: str, num_sms: int) -> None:
    q, cache, table, seq_lens, starts = decode_inputs(batch, context)
    out = torch.empty_like(q)
    nbytes = kv_bytes(batch, context)
    now, splits = engine_launch(batch, arch, num_sms)

    def run(config: AttentionConfig) -> None:
        paged_attention(
            q, cache[0], cache[1], out, starts, seq_lens, table, HEAD_SIZE**-0.5, None, config,
            splits, **kv_scales(),
        )  # fmt: skip

    results = {}
    reference = None
    # An e4m3 tile holds half the bytes of a bf16 one, so its sweep also tries 256 keys a step.
    tiles = (32, 64, 128, 256) if KV_FP8 else (32, 64, 128)
    for tile_n, warps, stages in itertools.product(tiles, (2, 4, 8), (2, 3, 4)):
        config = AttentionConfig(16, tile_n, warps, stages)
        try:
            run(config)
        except Exception:  # out of shared memory or registers
            continue
        if reference is None:
            reference = out.clone()
        err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        assert err < 1e-2, (config, err)
        results[config] = triton.testing.do_bench(
            lambda config=config: run(config), warmup=10, rep=50, return_mode="median"
        )
    best = sorted(results, key=results.get)[:3]
    ms_now = results.get(now, float("nan"))
    print(f"batch {batch}, context {context}, splits {splits}: now {now} "
          f"{ms_now * 1e3:.1f} us = {nbytes / (ms_now * 1e-3) / PEAK:.1%} of 4.28 TB/s")  # fmt: skip
    for config in best:
        ms = results[config]
        print(f"   {config}: {ms * 1e3:.1f} us = {nbytes / (ms * 1e-3) / PEAK:.1%}")


if __name__ == "__main__":
    main()
