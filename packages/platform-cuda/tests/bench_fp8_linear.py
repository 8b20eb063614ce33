"""FP8 linear throughput on the GPU (run by hand there; not a test), the layer as the model calls
it (``kvik_cuda.fp8``: activation quantization included):

1. M = 4096, N = K = 8192, bf16 activations: TFLOP/s of block FP8 (per-token-group activations,
   128 x 128 weight blocks; target 60% of PEAK_FP8_FLOPS) and per-channel FP8 (dynamic per-token
   activations; target 70%), beside bf16 ``F.linear`` and, for comparison, cuBLAS's blockwise
   scaling through ``torch.nn.functional.scaled_mm`` where this torch has it.
2. One row (batch-1 decode), Llama-3.1-8B's projections with block FP8 weights: GB/s of weight
   bytes (fp8 weight and its scales) against PEAK_BYTES_PER_S (target 70%). The weights are
   copied until the copies exceed the L2 cache several times and the timed call walks all of them,
   so every weight byte comes from memory.

``--shapes M:N:K ...`` times the first table at other shapes (decode batches of 128-512 rows on
the models' projections, where the tiled kernel's 128-row tiles leave SMs idle; one weight, which
may stay in the 60 MB L2 there, so compare those rows with each other); ``--sweep`` adds
the tiled kernel's candidate tilings there and the few-rows kernel's at one
row (kvik_cuda.tuning's ``*_CANDIDATES``); ``--rows 1 2 4 8 16`` times the decode shapes at other
row counts. Ceilings: the H200's measured fp8 ``torch._scaled_mm`` rate and copy bandwidth
(shared/KERNELS.md).

    python packages/platform-cuda/tests/bench_fp8_linear.py [--sweep] [--rows 1 4 16]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

import kvik_cuda.fp8
from kvik.triton_kernels.fp8_gemm import Fp8GemmConfig, Fp8GemvConfig
from kvik.triton_kernels.fp8_linear import (
    CublasBlockwise,
    cublas_blockwise_takes,
    fp8_block_linear,
    fp8_scaled_linear,
)
from kvik_cuda import tuning

PEAK_FP8_FLOPS = 1451e12
PEAK_BF16_FLOPS = 796e12
PEAK_BYTES_PER_S = 4.28e12
L2_BYTES = 60 * 2**20
LARGE = (4096, 8192, 8192)
# Llama-3.1-8B: fused qkv, o, fused gate_up, down, as [N, K].
DECODE_LAYERS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
DEVICE = torch.device("cuda")


def time_ms(fn: Callable[[], object]) -> float:
    # CUDA-graph replays, as the engine runs decode steps: at a few hundred rows a launch from
    # Python takes longer than the kernels, and plain do_bench timed the host.
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [n, k] and its block scales."""
    weight = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=DEVICE) * 1e-3 + 1e-4
    return weight, scale


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    blocks = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return weight.float() * blocks


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def large_rows(
    sweep: bool, shape: tuple[int, int, int] = LARGE
) -> list[tuple[str, Callable[[], torch.Tensor], float, torch.Tensor]]:
    """(name, call, peak, reference) rows of the table at ``shape`` (M, N, K)."""
    m, n, k = shape
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    weight, block_scale = fp8_weight(n, k)
    channel_scale = torch.rand(n, device=DEVICE) * 1e-3 + 1e-4
    bf16_weight = dequantized(weight, block_scale).bfloat16()
    ref_block = x.float() @ dequantized(weight, block_scale).T
    ref_channel = x.float() @ (weight.float() * channel_scale[:, None]).T
    rows = [
        ("bf16 F.linear", lambda: F.linear(x, bf16_weight), PEAK_BF16_FLOPS, ref_block),
        (
            "block fp8 (kvik_cuda.fp8)",
            lambda: kvik_cuda.fp8.fp8_block_linear(x, weight, block_scale, None),
            PEAK_FP8_FLOPS,
            ref_block,
        ),
        (
            "channel fp8 (kvik_cuda.fp8)",
            lambda: kvik_cuda.fp8.fp8_scaled_linear(x, weight, channel_scale, None, None),
            PEAK_FP8_FLOPS,
            ref_channel,
        ),
        (
            "channel fp8, Triton GEMM",
            lambda: fp8_scaled_linear(
                x,
                weight,
                channel_scale,
                None,
                None,
                tuning.fp8_gemm_config(kvik_cuda.fp8.arch_of(DEVICE), m, n, k),
                use_scaled_mm=False,
            ),  # fmt: skip
            PEAK_FP8_FLOPS,
            ref_channel,
        ),
    ]
    blockwise = cublas_blockwise(x, weight, block_scale)
    if blockwise is not None:
        rows.append(("block fp8, cuBLAS blockwise", blockwise, PEAK_FP8_FLOPS, ref_block))
    rows.append((
        "block fp8, Triton GEMM (its config)",
        lambda: fp8_block_linear(
            x, weight, block_scale, None,
            tuning.fp8_gemm_config(kvik_cuda.fp8.arch_of(DEVICE), m, n, k),
        ),
        PEAK_FP8_FLOPS,
        ref_block,
    ))  # fmt: skip
    if sweep:
        for name, config in tuning.FP8_GEMM_CANDIDATES.items():
            rows.append((
                f"  block fp8 {name}",
                lambda config=config: fp8_block_linear(x, weight, block_scale, None, config),
                PEAK_FP8_FLOPS,
                ref_block,
            ))  # fmt: skip
            rows.append((
                f"  channel fp8 Triton {name}",
                lambda config=config: fp8_scaled_linear(
                    x, weight, channel_scale, None, None, config, use_scaled_mm=False
                ),
                PEAK_FP8_FLOPS,
                ref_channel,
            ))  # fmt: skip
    return rows


def cublas_blockwise(
    x: torch.Tensor, weight: torch.Tensor, block_scale: torch.Tensor
) -> Callable[[], torch.Tensor] | None:
    """The same product on cuBLAS's 1x128 x 128x128 scaling (``CublasBlockwise``), quantization
    included, or None (the reason printed) where this torch or GPU does not take it."""
    if not cublas_blockwise_takes(x, weight, block_scale):
        print(
            "(no cuBLAS row: CublasBlockwise needs torch.nn.functional.scaled_mm, which torch "
            f"{torch.__version__} lacks, or a case it does not take)"
        )
        return None
    config = CublasBlockwise(tuning.FP8_GEMM_LARGE)

    def run() -> torch.Tensor:
        return fp8_block_linear(x, weight, block_scale, None, config)

    try:
        run()
    except (RuntimeError, ValueError, TypeError) as error:
        print(f"(cuBLAS blockwise scaling refused: {str(error).splitlines()[0][:150]})")
        return None
    return run


def print_large(sweep: bool, shape: tuple[int, int, int] = LARGE) -> None:
    m, n, k = shape
    flops = 2 * m * n * k
    print(
        f"\nM={m} N={n} K={k}, bf16 activations, quantization included; rel err against the"
        " fp32 product of unquantized activations (fp8 activation rounding alone: a few %)"
    )
    print(f"{'':36} {'ms':>8} {'TFLOP/s':>8} {'of peak':>8} {'rel err':>8}")
    for name, call, peak, ref in large_rows(sweep, shape):
        err = rel_err(call(), ref)
        ms = time_ms(call)
        tflops = flops / (ms * 1e-3) / 1e12
        print(f"{name:36} {ms:>8.3f} {tflops:>8.0f} {tflops * 1e12 / peak:>8.1%} {err:>8.1e}")
    print(f"(peaks: fp8 {PEAK_FP8_FLOPS / 1e12:.0f}, bf16 {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s; "
          "targets: block 60%, channel 70% of fp8)")  # fmt: skip


def time_walk(
    x: torch.Tensor,
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    config: Fp8GemmConfig | Fp8GemvConfig | None,
) -> tuple[torch.Tensor, float]:
    """(the first weight's product, ms to multiply ``x`` by every weight once); ``config`` None
    is the platform's own choice (kvik_cuda.fp8)."""

    def one(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if config is None:
            return kvik_cuda.fp8.fp8_block_linear(x, weight, scale, None)
        return fp8_block_linear(x, weight, scale, None, config)

    def walk() -> None:
        for weight, scale in weights:
            one(weight, scale)

    return one(*weights[0]), time_ms(walk)


def print_decode(rows_list: list[int], sweep: bool) -> None:
    print("\nDecode: Llama-3.1-8B's projections, block fp8 weights, bf16 activations")
    print(
        f"{'layer':8} {'rows':>4} {'config':28} {'us':>8} {'GB/s':>7} {'of 4.28':>8} {'rel err':>8}"
    )
    for layer, (n, k) in DECODE_LAYERS.items():
        weight_bytes = n * k + triton.cdiv(n, 128) * triton.cdiv(k, 128) * 4
        copies = max(1, triton.cdiv(4 * L2_BYTES, weight_bytes))
        weights = [fp8_weight(n, k) for _ in range(copies)]
        ref_weight = dequantized(*weights[0])
        for rows in rows_list:
            x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
            ref = x.float() @ ref_weight.T
            configs = {"kvik_cuda.fp8": None}
            if sweep and rows <= tuning.FP8_GEMV_MAX_ROWS:
                configs |= {f"  {name}": c for name, c in tuning.FP8_GEMV_CANDIDATES.items()}
            if sweep and rows > 1:
                configs["  tiled 16-row"] = tuning.fp8_gemm_config(
                    kvik_cuda.fp8.arch_of(DEVICE), rows, n, k
                )

            for name, config in configs.items():
                out, ms = time_walk(x, weights, config)
                err = rel_err(out, ref)
                us = ms * 1e3 / copies
                gbps = weight_bytes / (us * 1e-6) / 1e9
                print(f"{layer:8} {rows:>4} {name:28} {us:>8.1f} {gbps:>7.0f} "
                      f"{gbps * 1e9 / PEAK_BYTES_PER_S:>8.1%} {err:>8.1e}")  # fmt: skip
    print("(target: 70% of 4.28 TB/s at one row)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time the candidate tilings too")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="decode row counts")
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=lambda text: tuple(int(v) for v in text.split(":")),
        default=[LARGE],
        help="M:N:K of the throughput table (default 4096:8192:8192); e.g. a decode batch of "
        "256 on Llama-3.1-8B's qkv, 256:6144:4096, or Qwen3-30B-A3B's o, 256:2048:4096",
    )
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(DEVICE)
    print(f"{props.name}, sm{props.major}{props.minor}, {props.multi_processor_count} SMs, "
          f"torch {torch.__version__}, triton {triton.__version__}")  # fmt: skip
    for shape in args.shapes:
        print_large(args.sweep, shape)
    print_decode(args.rows, args.sweep)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
