"""Skinny products of Llama-3.1-8B's layers at decode batch sizes: kvik_cuda's GEMV (a sweep of
configurations) against cuBLAS (``F.linear``), on the H200.

    python packages/platform-cuda/tests/bench_gemv.py

Each shape gets 8 weight copies (more than the 60 MB L2 holds), used in turn inside one CUDA graph
of 32 products, so the time is a cold read of the weights without launch gaps; median of
``do_bench``'s repeats. Every configuration's result is checked against F.linear first.
"""

from __future__ import annotations

import itertools

import torch
import triton

from kvik_cuda.kernels.gemv import gemv, gemv_config

SHAPES = {  # name: (N, K)
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
COPIES = 8
CALLS = 32


def timed(fn, weights, x) -> float:
    """Median µs per product: CALLS products cycling over the weight copies in one graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(x, weights[i % len(weights)])
    return (
        triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3 / CALLS
    )


def main() -> None:
    torch.manual_seed(0)
    bw = 4.28e12
    print(f"{'layer':<14} {'M':>2} {'floor us':>8} {'cuBLAS us':>9} {'gemv default':>12} "
          f"{'best gemv':>9}  best config")  # fmt: skip
    for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 8)):
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), weights[0].float())
        floor = n * k * 2 / bw * 1e6
        cublas = timed(lambda a, w: torch.nn.functional.linear(a, w), weights, x)
        results = {}
        for bn, bk, warps, stages in itertools.product((8, 16, 32), (256, 512), (4,), (3, 4)):
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            try:
                out = gemv(x, weights[0], None, cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, err
                results[(bn, bk, warps, stages)] = timed(
                    lambda a, w, c=cfg: gemv(a, w, None, c), weights, x
                )
            except Exception as e:  # out of resources: skip the configuration
                results[(bn, bk, warps, stages)] = float("inf")
                if "resources" not in str(e) and "shared" not in str(e):
                    print("  error", cfg, str(e)[:100])
        default_cfg = gemv_config(n, k, triton.next_power_of_2(m))
        key = tuple(default_cfg[c] for c in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
        best = min(results, key=results.get)
        print(f"{name:<14} {m:>2} {floor:8.1f} {cublas:9.1f} {results.get(key, float('nan')):12.1f} "
              f"{results[best]:9.1f}  {best}")  # fmt: skip
        del weights


if __name__ == "__main__":
    main()
