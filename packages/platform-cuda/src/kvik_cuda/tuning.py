"""The launch configurations of the shared Triton kernels (attention, GEMV, FP8 products) on
NVIDIA GPUs.

``kvik.triton_kernels`` holds the kernels; which tiles, warps and pipeline stages suit an
architecture is this platform's choice, registered for the "sm" architectures when it is selected
(kvik_cuda.registration).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from kvik.triton_kernels.fp8_gemm import Fp8GemmConfig, Fp8GemvConfig
from kvik.triton_kernels.fp8_linear import CublasBlockwise
from kvik.triton_kernels.fp8_skinny import (
    SKINNY_MAX_ROWS,
    SKINNY_MIN_ROWS_PAD,
    Fp8SkinnyConfig,
    padded_rows,
)
from kvik.triton_kernels.gemv import GemvConfig
from kvik.triton_kernels.paged_attention import AttentionConfig, block_rows

#: fp32 heads of 128 and 256 (a row of 512 or 1024 bytes): (row bytes, prompt program?) ->
#: (keys a step, warps, stages). The 16-bit heads' (32, 4, 2) is where sm_90's ptxas falls into a
#: 32-register allocation with 5-13 KB of stack a thread, 5-15x slower. On an H100 (CUDA-graph
#: replays, 2026-12-06, docs/benchmarks.md "fp32 attention on Hopper"): 4 prompts of 1024 tokens
#: at head 128 took 13.2-43.9 ms in 4 warps and 1.5-4.7 ms in 8; 64 decodes at 1152 tokens 270-870
#: us in 32-key tiles and 160-520 in 64-key ones; at head 256, 64-key prompt tiles in 8 warps are
#: the one candidate that never fell into the 32-register mode (3.7-7.8 ms; 4 warps: 3.7-24.8),
#: and decodes take 0.48-0.97 ms in 2 warps against 5.3-10.8 in 4. Measured at 1, 2, 4 and 8 query
#: heads a KV head with ``sweep_wide_attention.py`` and its probe.
FP32_WIDE_ROWS: dict[tuple[int, bool], tuple[int, int, int]] = {
    (512, True): (32, 8, 2),
    (512, False): (64, 4, 2),
    (1024, True): (64, 8, 2),
    (1024, False): (32, 2, 2),
}


#: fp32 queries over an e4m3 cache: (padded head size, prompt program?) -> (keys a step, warps,
#: stages). The 16-bit queries' tiles compile there in ptxas's 32-register fallback on sm_90
#: (decodes' (64, 2, 3): 5.5-13.6 KB of stack a thread; prompts' (32, 4, 2): 6.5-20.6 KB).
#: Decodes timed on an H100 (docs/benchmarks.md "fp32 attention on Hopper"): 64 at 1152 tokens,
#: heads of 128, took 5,883 and 3,849 µs in (64, 2, 3) at groups 1 and 4 and 424 in (32, 4, 2),
#: the fastest of seven; heads of 256 compile to 168 registers in it (not timed). The prompt tiles
#: for heads of 128 are the candidate whose allocation stayed out of the fallback on sm_90 and
#: sm_100 at groups 1, 4 and 8 (255 and 110 registers), chosen from the compile; timed since on an
#: H100 (4 prompts of 1024): the fastest of six at group 1 (1,324 us against 3,683-8,086), 6% and
#: 10% behind the fastest at groups 4 and 8 (3,537 against 3,312; 6,298 against 5,687); for
#: heads of 256 no candidate left the fallback on sm_90, so they keep the general rule.
FP32_OVER_E4M3: dict[tuple[int, bool], tuple[int, int, int]] = {
    (128, True): (16, 8, 2),
    (128, False): (32, 4, 2),
    (256, False): (32, 4, 2),
}


@functools.cache
def attention_config(
    arch: str,
    head_size: int,
    group: int,
    max_query_len: int,
    dtype: torch.dtype,
    query_dtype: torch.dtype | None = None,
) -> AttentionConfig:
    """The configuration on ``arch`` ("sm90", "sm100", ...), as swept on the H200
    (docs/benchmarks.md, the twentieth session): decodes' 16-row programs walk 64 keys a step with
    2 warps in 3 stages (batch 256 at context 1152: 288 us a layer, 297 with 4 warps), prompt
    chunks' 64-row programs 32 keys in 2 stages (8 prompts of 1024: 284 us, 313 in 3 stages;
    128-row programs with 64 keys win only from ~8192-token chunks, by 2-3%). Where a row of the
    head is wider than 256 bytes: 16-bit heads of 256 take 32 keys, 4 warps and 2 stages, so the
    tiles fit Hopper's and Blackwell's shared memory; fp32 heads take ``FP32_WIDE_ROWS``. ``dtype``
    is the KV cache's; fp32 ``query_dtype`` over an e4m3 cache takes ``FP32_OVER_E4M3``."""
    if not arch.startswith("sm"):
        raise ValueError(f"kvik_cuda configures NVIDIA architectures (sm*), not {arch!r}")
    block_m = block_rows(group, max_query_len)
    over_e4m3 = (triton.next_power_of_2(head_size), block_m >= 64)
    if (
        dtype == torch.float8_e4m3fn
        and query_dtype == torch.float32
        and over_e4m3 in FP32_OVER_E4M3
    ):
        return AttentionConfig(block_m, *FP32_OVER_E4M3[over_e4m3])
    row_bytes = triton.next_power_of_2(head_size) * dtype.itemsize
    if dtype == torch.float32 and (row_bytes, block_m >= 64) in FP32_WIDE_ROWS:
        return AttentionConfig(block_m, *FP32_WIDE_ROWS[row_bytes, block_m >= 64])
    if row_bytes > 256:
        return AttentionConfig(block_m, 32, 4, 2)
    if block_m < 64:
        return AttentionConfig(block_m, 64, 2, 3)
    return AttentionConfig(block_m, 32, 4, 2)


#: Decode launches measured faster than ``attention_config`` with ``num_kv_splits`` on the H200
#: (132 SMs), for 128-wide heads in groups of 4 (Llama-3.1-8B, Qwen3-8B) over a 16-bit cache:
#: (fewest, most) (request, KV head) programs -> (configuration, split count). The default gives
#: the batches just past one wave of its 2-program-per-SM tiles a second, mostly empty wave; a
#: split in two with 2-stage tiles (3 programs an SM) spreads 40 requests over every SM.
#: From ``sweep_decode_attention.py --joint`` at 1152 tokens a request (2026-12-03, graph
#: replays; docs/benchmarks.md): 40 requests 61.6 -> 52.2 us a layer, 48 requests 63.4 -> 60.3,
#: 96 requests 126.7 -> 110.2. Each range holds the batches a captured graph pads to its top.
#: From 97 to 256 requests 32-key tiles in 2 stages win by 1-4% at every context swept: 128
#: requests at 1152 tokens 145.3 -> 142.7 us; 256 requests (workload B's decode batch) at 256,
#: 512, 640, 896 and 1152 tokens 72.9 -> 70.3, 133.2 -> 130.6, 165.0 -> 160.8, 224.0 -> 220.9,
#: 284.2 -> 283.8 (2026-12-04, ``benchmarks/results/2026-12-04T1005Z_probe_b_attention_*``).
H200_DECODE_PLANS: dict[tuple[int, int], tuple[AttentionConfig, int]] = {
    (33 * 8, 40 * 8): (AttentionConfig(16, 64, 4, 2), 2),
    (41 * 8, 48 * 8): (AttentionConfig(16, 64, 4, 3), 1),
    (89 * 8, 96 * 8): (AttentionConfig(16, 32, 2, 3), 1),
    (97 * 8, 256 * 8): (AttentionConfig(16, 32, 2, 2), 1),
}
#: The same over an e4m3 cache (its values read as 16-bit pairs, ``paged_attention``'s
#: ``V_PAIRS``), where the default 64-key tiles in 2 warps are not the fastest at large batches:
#: 32-key tiles in 2 warps, 2 stages. On the H200 128-key tiles in 4 warps had beaten the default
#: (2026-12-04: 256 requests at 640 tokens 105.6 -> 102.7 µs a layer, 97 at 640 50.8 -> 40.8) and
#: Nsight Compute timed the 32-key tiles level with them (102.7 against 103.7 µs, 2026-12-06).
#: On the H100 (2026-12-07, docs/benchmarks.md) the 32-key tiles win by 3.5-4.6%: 256 requests at
#: 640 tokens 132.9 -> 126.8 µs, 128 at 1152 117.3 -> 113.2, 256 at 256 58.3 -> 56.0; workload B
#: with FP8 weights and cache 24,467.5 -> 25,421.4 output tok/s.
H200_FP8_DECODE_PLANS: dict[tuple[int, int], tuple[AttentionConfig, int]] = {
    (97 * 8, 256 * 8): (AttentionConfig(16, 32, 2, 2), 1),
}
H200_SMS = 132


def decode_plan(
    arch: str,
    head_size: int,
    group: int,
    dtype: torch.dtype,
    programs: int,
    num_sms: int,
    query_dtype: torch.dtype | None = None,
) -> tuple[AttentionConfig, int] | None:
    """The measured decode launch for ``programs`` (request, KV head) pairs on ``arch``, or None
    (``kvik.triton_kernels.attention.decode_launch`` then takes the defaults). Only the shapes
    and machine the table was measured on (16-bit queries): a different SM count moves every
    wave boundary."""
    if (arch, num_sms, head_size, group) != ("sm90", H200_SMS, 128, 4):
        return None
    if query_dtype == torch.float32:
        return None
    if dtype == torch.float8_e4m3fn:
        plans = H200_FP8_DECODE_PLANS
    elif dtype in (torch.bfloat16, torch.float16):
        plans = H200_DECODE_PLANS
    else:
        return None
    for (fewest, most), plan in plans.items():
        if fewest <= programs <= most:
            return plan
    return None


#: The longest inner dimension the one-row GEMV takes: past it, a program's loop over K is long and
#: the programs few (N / block_n), and cuBLAS's split-K product wins (Llama-3.1-8B's down_proj,
#: K = 14336, on the H200: docs/benchmarks.md).
GEMV_MAX_K = 8192


def gemv_config(arch: str, out_features: int, in_features: int) -> GemvConfig | None:
    """The one-row GEMV's configuration for a layer on ``arch``, or None to leave it to cuBLAS.

    Measured on Hopper only (the H200, Llama-3.1-8B's projections in a batch-1 decode step), so
    other architectures keep cuBLAS until they are measured. Wide layers (gate_up) take wider
    programs with a shorter K step."""
    if arch != "sm90" or in_features > GEMV_MAX_K:
        return None
    if out_features >= 16384:
        return GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
    return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)


#: The fp8 tiled kernel's tiles on Hopper and Blackwell, by the rows of the product: 128 x 128
#: tiles in 4 stages (32 KB of A and W a stage) with 8 warps (two warpgroups) for prefills;
#: 64-row tiles (one warpgroup's MMA) for medium batches; 16-row tiles (the MMAs without
#: warpgroups) and narrow columns for small ones, so that a layer still spreads over the SMs
#: (32 columns for narrow layers: 128 programs for 4096 outputs).
#: Not yet measured: ``bench_fp8_linear.py --sweep`` times these and the candidates below.
FP8_GEMM_LARGE = Fp8GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4)
FP8_GEMM_MEDIUM = Fp8GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4)
FP8_GEMM_SMALL = Fp8GemmConfig(block_m=16, block_n=64, group_m=1, num_warps=4, num_stages=5)
FP8_GEMM_SMALL_NARROW = Fp8GemmConfig(block_m=16, block_n=32, group_m=1, num_warps=4, num_stages=6)
#: Further tilings for prefills, for the bench's sweep.
FP8_GEMM_CANDIDATES = {
    "128x128 w8 s4": FP8_GEMM_LARGE,
    "128x128 w4 s4": Fp8GemmConfig(128, 128, 8, 4, 4),
    "128x256 w8 s3": Fp8GemmConfig(128, 256, 8, 8, 3),
    "64x256 w4 s4": Fp8GemmConfig(64, 256, 8, 4, 4),
    "64x128 w4 s4": FP8_GEMM_MEDIUM,
    "64x64 w4 s4": Fp8GemmConfig(64, 64, 8, 4, 4),
}
#: Up to this many rows a block-FP8 product runs on the few-rows kernel (CUDA cores, the
#: activations quantized inside, one launch): its arithmetic grows with the rows while the weight
#: read does not, so larger batches take the tensor cores.
FP8_GEMV_MAX_ROWS = 4
#: The few-rows kernel's tilings for the bench's sweep: output columns, groups of 128 a K step,
#: and "pre" where the activations are quantized by a launch of their own.
FP8_GEMV_CANDIDATES = {
    "n8 g4": Fp8GemvConfig(8, 4, FP8_GEMV_MAX_ROWS, 4, 3),
    "n8 g4 pre": Fp8GemvConfig(8, 4, FP8_GEMV_MAX_ROWS, 4, 3, prequantize=True),
    "n16 g2": Fp8GemvConfig(16, 2, FP8_GEMV_MAX_ROWS, 4, 3),
    "n16 g4": Fp8GemvConfig(16, 4, FP8_GEMV_MAX_ROWS, 4, 3),
    "n16 g4 pre": Fp8GemvConfig(16, 4, FP8_GEMV_MAX_ROWS, 4, 3, prequantize=True),
    "n32 g2": Fp8GemvConfig(32, 2, FP8_GEMV_MAX_ROWS, 4, 4),
    "n32 g2 pre": Fp8GemvConfig(32, 2, FP8_GEMV_MAX_ROWS, 4, 4, prequantize=True),
    "n4 g8 pre": Fp8GemvConfig(4, 8, FP8_GEMV_MAX_ROWS, 4, 3, prequantize=True),
    # o's fastest at one row was n4 g8 pre (41.7% of the bandwidth): narrower and shorter around it.
    "n4 g4 pre": Fp8GemvConfig(4, 4, FP8_GEMV_MAX_ROWS, 4, 3, prequantize=True),
    "n2 g8 pre": Fp8GemvConfig(2, 8, FP8_GEMV_MAX_ROWS, 4, 3, prequantize=True),
    "n4 g8 s4 pre": Fp8GemvConfig(4, 8, FP8_GEMV_MAX_ROWS, 4, 4, prequantize=True),
    # The bf16 GEMV's bytes a step on gate_up (32 rows x 512 bytes, 92% of the H200's bandwidth
    # where the FP8 forms reach ~75%), in 8 warps for the registers the e4m3 values widen into.
    # On the H200 no faster than the others (gate_up 36.7 and 37.2 µs; docs/benchmarks.md).
    "n32 g4 w8 pre": Fp8GemvConfig(32, 4, FP8_GEMV_MAX_ROWS, 8, 3, prequantize=True),
    "n16 g8 w8 pre": Fp8GemvConfig(16, 8, FP8_GEMV_MAX_ROWS, 8, 3, prequantize=True),
}


def check_nvidia(arch: str) -> None:
    if not arch.startswith("sm"):
        raise ValueError(f"kvik_cuda configures NVIDIA architectures (sm*), not {arch!r}")


def fp8_gemm_config(arch: str, m: int, n: int, k: int) -> Fp8GemmConfig:
    """The fp8 tiled kernel's configuration for an [m, k] x [n, k]^T product on ``arch`` (block or
    per-channel scales alike)."""
    check_nvidia(arch)
    if m <= 16:
        return FP8_GEMM_SMALL if n >= 16384 else FP8_GEMM_SMALL_NARROW
    if m <= 64:
        return FP8_GEMM_MEDIUM
    return FP8_GEMM_LARGE


def fp8_gemv_config(arch: str, n: int, k: int) -> Fp8GemvConfig:
    """The few-rows block-FP8 kernel's configuration for a weight [n, k] on ``arch``: narrow
    programs with long K steps for narrow layers (enough programs to fill the SMs), wider ones
    with shorter steps for wide layers (as the bf16 GEMV). Narrow programs would each redo the
    activations' quantization for few columns (tens of operations an element against a few a
    weight), so narrow layers take them quantized by a launch of their own; wide programs
    quantize inside, in one launch."""
    check_nvidia(arch)
    if n >= 16384:
        return FP8_GEMV_CANDIDATES["n32 g2"]
    return FP8_GEMV_CANDIDATES["n8 g4 pre"]


def fp8_block_config(
    arch: str, m: int, n: int, k: int
) -> Fp8GemmConfig | Fp8GemvConfig | Fp8SkinnyConfig | CublasBlockwise:
    """``kvik.triton_kernels.fp8_linear.fp8_block_linear``'s configuration for ``m`` rows: the
    CUDA-core GEMV at one row, the Triton tiled kernel from 2 rows (the few-rows kernel instead
    where ``FP8_BLOCK_FEW_ROWS`` lists the layer), the few-rows tensor-core kernel
    from ``FP8_BLOCK_SKINNY_MIN_ROWS`` to ``SKINNY_MAX_ROWS`` (with ``FP8_SKINNY`` off: the GEMV up
    to ``FP8_GEMV_MAX_ROWS`` and the tiled kernel above, as before that kernel), the tiled kernel
    again up to ``FP8_CUBLAS_MIN_ROWS``, cuBLAS's blockwise scaling above (on Hopper). On the H200 with
    Llama-3.1-8B's projections, CUDA-graph timed (docs/benchmarks.md), cuBLAS took 161 µs a
    layer's four products at 256 rows against the tiled kernel's 244 and 3.68 ms against 5.44 at
    8192 rows."""
    if FP8_SKINNY:
        if FP8_BLOCK_SKINNY_MIN_ROWS <= m <= SKINNY_MAX_ROWS:
            return fp8_skinny_config(arch, m, n, k)
        few_rows = fp8_block_few_rows_config(arch, m, n, k)
        if few_rows is not None:
            return few_rows
        if m == 1:
            return fp8_gemv_config(arch, n, k)
    elif m <= FP8_GEMV_MAX_ROWS:
        return fp8_gemv_config(arch, n, k)
    if m >= FP8_CUBLAS_MIN_ROWS and arch == "sm90":
        return CublasBlockwise(fallback=fp8_gemm_config(arch, m, n, k))
    return fp8_gemm_config(arch, m, n, k)


def fp8_scaled_config(arch: str, m: int, n: int, k: int) -> Fp8GemmConfig | Fp8SkinnyConfig:
    """``kvik.triton_kernels.fp8_linear.fp8_scaled_linear``'s configuration (per-tensor or
    per-channel scales): the few-rows kernel up to ``FP8_SCALED_SKINNY_MAX_ROWS`` rows (where
    ``FP8_SKINNY`` is on), else the tiled kernel's tiles (which that function uses where
    ``torch._scaled_mm`` does not take the case)."""
    if FP8_SKINNY and m <= FP8_SCALED_SKINNY_MAX_ROWS:
        return fp8_skinny_config(arch, m, n, k)
    return fp8_gemm_config(arch, m, n, k)


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable: "1" or "0" (unset or empty: ``default``)."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name} must be 1 (on) or 0 (off), not {raw!r}")
    return default if raw == "" else raw == "1"


#: ``KVIK_FP8_SKINNY=0`` turns the few-rows tensor-core kernel off: FP8 products of up to 64 rows
#: go back to the kernels used before it (block scales: the CUDA-core GEMV up to
#: ``FP8_GEMV_MAX_ROWS`` rows, the tiled kernel above; per-channel: ``torch._scaled_mm``). The
#: switch for a GPU where ``bench/fp8_gpu.py`` reports it wrong; read when kvik_cuda.tuning is
#: imported (a process sets it before starting the engine).
FP8_SKINNY = env_switch("KVIK_FP8_SKINNY", default=True)

#: RMSNorm and SiLU-and-mul write the quantized input of the block-FP8 projection they feed
#: (kvik.quantization.activation: one launch fewer for each of q/k/v, gate/up and down). On the
#: H200, Llama-3.1-8B block FP8 at batch 1: 312.4 -> 323.4 output tok/s (docs/benchmarks.md);
#: ``KVIK_FUSED_ACTIVATION_QUANT=0`` turns it off.
FUSED_ACTIVATION_QUANT = env_switch("KVIK_FUSED_ACTIVATION_QUANT", default=True)

#: A block-FP8 gate/up product on the few-rows kernel applies SiLU-and-mul and writes down's
#: quantized input in its last step (kvik.triton_kernels.fp8_skinny_glu: one launch fewer a layer
#: at decode batch sizes). Off by default: on the H100 the one launch reads the weights more slowly
#: than the plain product (Llama-3.1-8B's gate/up at 1/4/16 rows: 50.1/56.8/53.7 µs against the
#: two launches' 46.2/47.3/49.0) and batch 1 loses 260.0 -> 250.2 output tok/s
#: (docs/benchmarks.md). ``KVIK_FP8_GATE_UP_SILU=1`` turns it on.
FP8_GATE_UP_SILU = env_switch("KVIK_FP8_GATE_UP_SILU", default=False)

#: Where the few-rows kernel is faster, from ``bench/fp8_gpu.py`` on the H200 (2026-12-01,
#: docs/benchmarks.md; CUDA-graph timed, Llama-3.1-8B's projections). Block scales: slower than
#: the GEMV and the tiled kernel up to 16 rows (gate_up at one row 132 µs against the GEMV's 47,
#: at 8 rows 133 against the tiled kernel's 39), faster or level from 17 to 64 (down at 32 rows 28
#: µs against 53, o 15 against 19); between 2 and 16 rows the tiled kernel beats the GEMV (gate_up
#: 39 µs at 8 rows against the GEMV's 75 at 2). Per-channel scales: faster than the kernels before
#: it up to 32 rows (qkv at one row 14 µs against 23, gate_up 36 against 51), level or slower at 64.
FP8_BLOCK_SKINNY_MIN_ROWS = 17
FP8_SCALED_SKINNY_MAX_ROWS = 32
#: The few-rows kernel's programs: 128 weight rows (a weight-scale block: one scale a K step),
#: 4 warps (one warpgroup's wgmma), 3 pipeline stages (two 16 KB weight tiles in flight while one
#: is multiplied). K is split until the layer has as many programs as fit on the GPU at once
#: (the H100's and H200's 132 multiprocessors; three programs each up to 32 padded rows, two at
#: 64 rows, where the [128, 64] fp32 sums take about 240 registers a thread), so all are resident
#: and stream their weight rows together, while each keeps at least
#: ``SKINNY_MIN_GROUPS_PER_SPLIT`` K steps to pipeline.
SKINNY_BLOCK_N = 128
SKINNY_MULTIPROCESSORS = 132
SKINNY_MIN_GROUPS_PER_SPLIT = 4
SKINNY_MAX_SPLIT = 16
#: Up to this many rows the activations are quantized inside the few-rows kernel (one launch);
#: above, each program would redo too much of it (CUDA-core work per weight byte grows with the
#: padded rows), so a launch of their own quantizes them first.
SKINNY_QUANTIZE_MAX_ROWS = 16


def skinny_programs_per_sm(rows: int) -> int:
    """Programs of the few-rows kernel resident on a multiprocessor at ``rows`` padded rows."""
    return 3 if rows <= 32 else 2


def skinny_split(n: int, k: int, rows: int = 16) -> int:
    """How many ways the few-rows kernel splits K for a weight [n, k] at ``rows`` padded rows
    (at most: the launcher takes the most ways up to it that divide K's groups evenly)."""
    tiles, groups = triton.cdiv(n, SKINNY_BLOCK_N), triton.cdiv(k, 128)
    resident = skinny_programs_per_sm(rows) * SKINNY_MULTIPROCESSORS
    split = 1
    while (
        split * 2 <= SKINNY_MAX_SPLIT
        and tiles * split * 2 <= resident
        and groups // (split * 2) >= SKINNY_MIN_GROUPS_PER_SPLIT
    ):
        split *= 2
    return split


def fp8_skinny_config(arch: str, m: int, n: int, k: int) -> Fp8SkinnyConfig:
    """The few-rows kernel's launch for ``m`` rows (1 to ``SKINNY_MAX_ROWS``) of a weight [n, k]:
    it depends on the layer and on the rows' padded size (16, 32, 64) only, so every variant
    compiles when the decode batch sizes are captured."""
    check_nvidia(arch)
    rows = padded_rows(m)
    return Fp8SkinnyConfig(
        block_n=SKINNY_BLOCK_N,
        split_k=skinny_split(n, k, rows),
        num_warps=4,
        num_stages=3,
        quantize=rows <= SKINNY_QUANTIZE_MAX_ROWS,
    )


#: From this many rows block-FP8 products go to cuBLAS's blockwise scaling (``fp8_block_config``).
FP8_CUBLAS_MIN_ROWS = 128


#: Block-FP8 products of 1 to ``FP8_BLOCK_SKINNY_MIN_ROWS - 1`` rows on the few-rows kernel (or,
#: at one row, another GEMV tiling), where ``bench/fp8_few_rows_gpu.py`` measured it faster on
#: Hopper (the H200) than the kernels those rows take otherwise (the GEMV's ``fp8_gemv_config`` at
#: one row, the tiled kernel from 2): a layer's (N, K) -> {most rows: the launch, or None for those
#: kernels}; a product of ``m`` rows takes the entry of the fewest rows at or above ``m``. Layers
#: not listed keep the GEMV and the tiled kernel. The sweep prints this table's text from its
#: measurements, to paste here. Measured on the H200 at commit ae9bfe0 (2026-12-01 09:42Z,
#: docs/benchmarks.md): every listed launch beat the kernels before it, by 4-46%.
FP8_BLOCK_FEW_ROWS: dict[tuple[int, int], dict[int, Fp8SkinnyConfig | Fp8GemvConfig | None]] = {
    (28672, 4096): {  # gate_up
        1: Fp8SkinnyConfig(block_n=128, split_k=1, num_warps=4, num_stages=4, quantize=False),
        2: Fp8SkinnyConfig(block_n=64, split_k=1, num_warps=4, num_stages=4, quantize=False),
        4: Fp8SkinnyConfig(block_n=64, split_k=1, num_warps=4, num_stages=4, quantize=False),
        8: Fp8SkinnyConfig(block_n=128, split_k=1, num_warps=4, num_stages=4, quantize=False),
        16: Fp8SkinnyConfig(block_n=128, split_k=1, num_warps=4, num_stages=4, quantize=False),
    },
    (4096, 14336): {  # down
        1: Fp8SkinnyConfig(block_n=128, split_k=8, num_warps=4, num_stages=3, quantize=False),
        2: Fp8SkinnyConfig(block_n=128, split_k=8, num_warps=4, num_stages=3, quantize=False),
        4: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        8: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        16: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
    },
    (6144, 4096): {  # qkv
        1: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        2: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        4: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        8: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        16: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
    },
    (4096, 4096): {  # o
        1: Fp8GemvConfig(
            block_n=4, groups=8, max_rows=4, num_warps=4, num_stages=4, prequantize=True
        ),
        2: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        4: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        8: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
        16: Fp8SkinnyConfig(block_n=64, split_k=4, num_warps=4, num_stages=4, quantize=False),
    },
}


def fp8_block_few_rows_config(
    arch: str, m: int, n: int, k: int
) -> Fp8SkinnyConfig | Fp8GemvConfig | None:
    """The few-rows kernel's launch for a block-FP8 product of ``m`` rows below
    ``FP8_BLOCK_SKINNY_MIN_ROWS``, where ``FP8_BLOCK_FEW_ROWS`` lists the layer and the rows on
    Hopper; else None."""
    if arch != "sm90" or not 1 <= m < FP8_BLOCK_SKINNY_MIN_ROWS:
        return None
    by_rows = FP8_BLOCK_FEW_ROWS.get((n, k), {})
    at_or_above = [rows for rows in by_rows if rows >= m]
    return by_rows[min(at_or_above)] if at_or_above else None


def fp8_block_few_rows_candidates(n: int, k: int) -> dict[str, Fp8SkinnyConfig]:
    """The few-rows kernel's launches ``bench/fp8_few_rows_gpu.py`` times for a block-FP8 weight
    [n, k] at 1 to 16 rows (one padded size, 16: a launch compiles once for them all). Around the
    tuning's own (``fp8_skinny_config``, activations quantized inside), the activations quantized
    by a launch of their own first ("pre": no per-step quantization on the CUDA cores, which every
    program redoes for all 16 padded rows; on the H200 every fastest launch was one of these, the
    in-kernel forms 1.5-2.7x slower, so only the tuning's own is kept as the baseline): deeper
    pipelines (more weight tiles in flight a program), programs of half and twice the width (twice
    and half the programs), 8 warps, and half and twice the K splits (narrow layers at one row run
    at 40-50% of the bandwidth: fewer, longer K loops or more, shorter ones); and stages of 2 or
    4 groups (``groups_per_step``: a stage reads each weight row in one run of 256 or 512 bytes
    rather than 128), split into the groups' tiles in registers or multiplied whole with the
    other groups' activations zeroed (``masked_groups``)."""
    split = skinny_split(n, k, SKINNY_MIN_ROWS_PAD)
    more_split = min(SKINNY_MAX_SPLIT, split * 2)
    less_split = max(1, split // 2)
    return {
        "n128 s3 quant (tuning)": Fp8SkinnyConfig(128, split, 4, 3),
        "n128 s3 pre": Fp8SkinnyConfig(128, split, 4, 3, quantize=False),
        "n128 s5 pre": Fp8SkinnyConfig(128, split, 4, 5, quantize=False),
        "n128 s7 pre": Fp8SkinnyConfig(128, split, 4, 7, quantize=False),
        f"n128 s5 pre split {more_split}": Fp8SkinnyConfig(128, more_split, 4, 5, quantize=False),
        f"n128 s4 pre split {less_split}": Fp8SkinnyConfig(128, less_split, 4, 4, quantize=False),
        f"n64 s4 pre split {less_split}": Fp8SkinnyConfig(64, less_split, 4, 4, quantize=False),
        "n64 s5 pre": Fp8SkinnyConfig(64, split, 4, 5, quantize=False),
        "n256 w8 s4 pre": Fp8SkinnyConfig(256, split, 8, 4, quantize=False),
        "n128 s3 pre g2": Fp8SkinnyConfig(128, split, 4, 3, quantize=False, groups_per_step=2),
        "n128 s3 pre g4": Fp8SkinnyConfig(128, split, 4, 3, quantize=False, groups_per_step=4),
        f"n128 s2 pre split {less_split} g4": Fp8SkinnyConfig(
            128, less_split, 4, 2, quantize=False, groups_per_step=4
        ),
        f"n64 s4 pre split {less_split} g2": Fp8SkinnyConfig(
            64, less_split, 4, 4, quantize=False, groups_per_step=2
        ),
        f"n64 s2 pre split {less_split} g4 masked": Fp8SkinnyConfig(
            64, less_split, 4, 2, quantize=False, groups_per_step=4, masked_groups=True
        ),
        f"n64 s3 pre split {less_split} g4 masked": Fp8SkinnyConfig(
            64, less_split, 4, 3, quantize=False, groups_per_step=4, masked_groups=True
        ),
        "n128 s2 pre g4 masked": Fp8SkinnyConfig(
            128, split, 4, 2, quantize=False, groups_per_step=4, masked_groups=True
        ),
        "n64 s4 pre g2 masked": Fp8SkinnyConfig(
            64, split, 4, 4, quantize=False, groups_per_step=2, masked_groups=True
        ),
    }
