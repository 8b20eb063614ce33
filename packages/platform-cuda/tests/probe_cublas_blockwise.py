"""Which row counts cuBLAS's blockwise-scaled FP8 product takes, and its speed against kvik's Triton
kernels and bf16, on Llama-3.1-8B's projections (CUDA-graph timed, µs a product).

    python3 packages/platform-cuda/tests/probe_cublas_blockwise.py    # on the H200; $OUT/cublas_probe.json

"pad1" hands cuBLAS the scales as they are; "pad4"/"pad16" try a padded scale stride (torch
refuses it: the stride must be M). Found on the H200: every M that is not a multiple of 4 fails
with CUBLAS_STATUS_NOT_SUPPORTED, hence the zero rows kvik.triton_kernels.fp8_linear appends.
"""

# ruff: noqa
import json
import os
import time

import torch
import torch.nn.functional as F

from kvik.triton_kernels.fp8_quant import per_token_group_quant_fp8
from kvik.triton_kernels.fp8_gemm import fp8_block_matmul, Fp8GemmConfig

torch.manual_seed(0)
dev = "cuda"
res = {"torch": torch.__version__}
shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
cfg = Fp8GemmConfig(64, 128, 8, 4, 3)


def quant_w(n, k):
    w = torch.randn(n, k, device=dev) * 0.05
    q = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(n // 128, k // 128, device=dev, dtype=torch.float32) * 0.01 + 0.001
    return q, s.contiguous()


def cublas(x, q, s, pad):
    m, k = x.shape
    xq, xs = per_token_group_quant_fp8(x)  # row-major [M, G]
    groups = xs.shape[1]
    mp = (m + pad - 1) // pad * pad
    buf = torch.empty(groups, mp, device=dev, dtype=torch.float32)
    buf[:, :m] = xs.t()
    xs_cm = buf[:, :m].t()
    return F.scaled_mm(
        xq,
        q.t(),
        xs_cm,
        F.ScalingType.BlockWise1x128,
        s.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )


ms = list(range(1, 21)) + [31, 32, 33, 127, 128, 129, 255, 256, 257, 1000, 4096]
for n, k in shapes:
    q, s = quant_w(n, k)
    for pad in (1, 4, 16):
        bad = []
        errs = []
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            try:
                out = cublas(x, q, s, pad)
                ref = fp8_block_matmul(x, q, s, None, cfg)
                errs.append(
                    ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                )
            except Exception as exc:
                bad.append((m, type(exc).__name__ + ": " + str(exc)[:120]))
        res[f"{n}x{k} pad{pad}"] = {
            "failed": bad[:6],
            "num_failed": len(bad),
            "max_rel_err": max(errs) if errs else None,
        }


# timing at M=256 and 8192 with graphs: cuBLAS vs Triton tiled
def gtime(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters / 10 * 1e6


from kvik_cuda.tuning import fp8_block_config, FP8_GEMM_SMALL, FP8_GEMM_SMALL_NARROW

for m in (1, 16, 64, 256, 8192):
    for n, k in shapes:
        q, s = quant_w(n, k)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        row = {}
        for pad in (16,):
            try:
                row["cublas_us"] = gtime(lambda: cublas(x, q, s, pad))
            except Exception as exc:
                row["cublas_exc"] = str(exc)[:100]
        row["kvik_us"] = gtime(
            lambda: fp8_block_matmul(x, q, s, None, fp8_block_config("sm90", m, n, k))
        )
        if m == 1:
            row["tiled_small_us"] = gtime(lambda: fp8_block_matmul(x, q, s, None, FP8_GEMM_SMALL))
            row["tiled_narrow_us"] = gtime(
                lambda: fp8_block_matmul(x, q, s, None, FP8_GEMM_SMALL_NARROW)
            )
        row["weight_GBps_kvik"] = n * k / row["kvik_us"] / 1e3
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        row["bf16_us"] = gtime(lambda: F.linear(x, w16))
        res[f"time m{m} {n}x{k}"] = row
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "cublas_probe.json"), "w"), indent=1)
