"""The FP8 kernels compile ahead of time for kvik_cuda's targets (Hopper, Blackwell) at the
configurations its tuning picks and the bench sweeps, specialized for aligned pointers and strides
as the JIT does at Llama's sizes: within shared memory with every pipeline stage; on Hopper with
pipelined loads and (tiles of 64 rows or more) wgmma; with IEEE division and round-to-nearest-even
e4m3 conversions in the activation quantization. Skipped without kvik_cuda (e4m3fn is NVIDIA's
fp8; ROCm's MI300X has the fnuz variant, which these kernels are not registered for)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

pytest.importorskip("triton")
aot = pytest.importorskip("kvik_cuda.aot")
tuning = pytest.importorskip("kvik_cuda.tuning")

from kvik.triton_kernels.aot import compile_as_launched  # noqa: E402
from kvik.triton_kernels.fp8_gemm import (  # noqa: E402
    GEMM_BLOCK_K,
    GROUP_SIZE,
    Fp8GemmConfig,
    Fp8GemvConfig,
    fp8_block_gemv_kernel,
    fp8_gemm_kernel,
)
from kvik.triton_kernels.fp8_linear import CublasBlockwise  # noqa: E402
from kvik.triton_kernels.fp8_quant import (  # noqa: E402
    GROUP_QUANT_GROUPS_PER_PROGRAM,
    GROUP_QUANT_WARPS,
    TOKEN_QUANT_BLOCK,
    TOKEN_QUANT_WARPS,
    per_token_group_quant_kernel,
    per_token_quant_kernel,
)
from kvik.triton_kernels.fp8_skinny import (  # noqa: E402
    Fp8SkinnyConfig,
    fp8_skinny_kernel,
    groups_a_step,
    padded_rows,
)
from kvik.triton_kernels.fp8_skinny_glu import fp8_skinny_glu_kernel, glu_config  # noqa: E402
from kvik.triton_kernels.fused_moe import (  # noqa: E402
    SUM_LAST_MAX_TOKENS,
    even_tiles,
    moe_gemm_kernel,
    step_constexprs,
)
from kvik_cuda.moe_tuning import fused_moe_config  # noqa: E402

ARCHS = list(aot.TARGETS)
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES = list(TRITON_TYPES)
FP8_POINTERS = ("q_ptr", "a_ptr", "w_ptr")
FP32_POINTERS = ("scale_ptr", "a_scale_ptr", "w_scale_ptr", "x_scale_ptr", "partial_ptr")


def types(kernel, dtype: torch.dtype, fp8_inputs: bool = False) -> dict[str, str]:
    """fp8 operands (the GEMV's x too where ``fp8_inputs``), fp32 scales, ``dtype`` for the rest
    of the pointers, 32-bit integers."""

    def one(name: str) -> str:
        if name in FP8_POINTERS or (fp8_inputs and name == "x_ptr"):
            return "*fp8e4nv"
        if name in FP32_POINTERS:
            return "*fp32"
        if name == "counter_ptr":
            return "*i32"
        return f"*{TRITON_TYPES[dtype]}" if name.endswith("_ptr") else "i32"

    return {name: one(name) for name in kernel.arg_names}


def aligned(kernel) -> tuple[str, ...]:
    """Pointers and strides: multiples of 16 at the sizes compiled here (K = 4096 rows of
    contiguous tensors), which the JIT specializes for at a launch."""
    return tuple(n for n in kernel.arg_names if n.endswith(("_ptr", "_stride")))


def compiled_ok(kernel, arch: str, **kwargs):
    """``kernel`` compiled for ``arch`` as a launch there builds it (``compile_as_launched``),
    within its shared memory."""
    compiled = compile_as_launched(kernel, aot.TARGETS[arch], **kwargs)
    assert compiled.metadata.shared <= aot.SHARED_MEMORY_LIMIT[arch]
    return compiled


def check_quantization(ptx: str, round_in_software: bool = True) -> None:
    """IEEE division (as torch's), the rounding helper's subtraction of 1.5 * 2**23 kept (not
    folded away) where the kernel rounds in software (else absent: the cast rounds), and fp32 ->
    e4m3 conversions that round to nearest even."""
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert ("0fCB400000" in ptx) == round_in_software
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("software", [False, True], ids=["cast-rounds", "software-rounds"])
def test_per_token_group_quant(arch: str, dtype: torch.dtype, software: bool) -> None:
    compiled = compiled_ok(
        per_token_group_quant_kernel,
        arch,
        types=types(per_token_group_quant_kernel, dtype),
        constexprs={
            "GROUP": GROUP_SIZE,
            "GROUPS_PER_PROGRAM": GROUP_QUANT_GROUPS_PER_PROGRAM,
            "ROUND_IN_SOFTWARE": software,
        },
        num_warps=GROUP_QUANT_WARPS,
        aligned=aligned(per_token_group_quant_kernel),
    )
    check_quantization(compiled.asm["ptx"], software)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("software", [False, True], ids=["cast-rounds", "software-rounds"])
def test_per_token_quant(arch: str, dtype: torch.dtype, static: bool, software: bool) -> None:
    compiled = compiled_ok(
        per_token_quant_kernel,
        arch,
        types=types(per_token_quant_kernel, dtype),
        constexprs={
            "K": 4096,
            "STATIC_SCALE": static,
            "BLOCK": TOKEN_QUANT_BLOCK,
            "ROUND_IN_SOFTWARE": software,
        },
        num_warps=TOKEN_QUANT_WARPS,
        aligned=aligned(per_token_quant_kernel),
    )
    check_quantization(compiled.asm["ptx"], software)


GEMM_CONFIGS = {
    "small": tuning.FP8_GEMM_SMALL,
    "small narrow": tuning.FP8_GEMM_SMALL_NARROW,
    "medium": tuning.FP8_GEMM_MEDIUM,
    **tuning.FP8_GEMM_CANDIDATES,
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", GEMM_CONFIGS.values(), ids=GEMM_CONFIGS.keys())
@pytest.mark.parametrize(
    ("block_scales", "k", "bias", "dtype"),
    [(True, 4096, False, torch.bfloat16), (False, 4096, True, torch.bfloat16)],
    ids=["block", "channel"],
)
def test_fp8_gemm(
    arch: str, config: Fp8GemmConfig, block_scales: bool, k: int, bias: bool, dtype: torch.dtype
) -> None:
    compiled = compiled_ok(
        fp8_gemm_kernel,
        arch,
        types=types(fp8_gemm_kernel, dtype),
        constexprs={
            "K": k,
            "BLOCK_SCALES": block_scales,
            "HAS_BIAS": bias,
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "BLOCK_K": GEMM_BLOCK_K,
            "GROUP_M": config.group_m,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        aligned=aligned(fp8_gemm_kernel),
    )
    if arch == "sm90":
        # The tiles' loads pipelined through shared memory, in the stages asked for.
        assert "cp.async" in compiled.asm["ptx"]
        if config.block_m >= 64:
            assert "wgmma" in compiled.asm["ptx"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_gemm_with_a_k_tail(arch: str, dtype: torch.dtype) -> None:
    """K no multiple of 128 (masked loads), the output in fp16 and fp32."""
    config = tuning.FP8_GEMM_LARGE
    compiled_ok(
        fp8_gemm_kernel,
        arch,
        types=types(fp8_gemm_kernel, dtype),
        constexprs={
            "K": 1500,
            "BLOCK_SCALES": True,
            "HAS_BIAS": True,
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "BLOCK_K": GEMM_BLOCK_K,
            "GROUP_M": config.group_m,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def gemv_cases() -> list:
    """The tuning's choices for Llama-3.1-8B's layers at one row and at FP8_GEMV_MAX_ROWS rows,
    and every sweep candidate at one row."""
    cases = []
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        config = tuning.fp8_gemv_config("sm90", n, k)
        for rows in (1, tuning.FP8_GEMV_MAX_ROWS):
            cases.append(pytest.param(config, k, rows, id=f"{n}x{k}-m{rows}"))
    for name, config in tuning.FP8_GEMV_CANDIDATES.items():
        cases.append(pytest.param(config, 4096, 1, id=f"sweep-{name}"))
    return cases


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("config", "k", "rows"), gemv_cases())
def test_fp8_block_gemv(arch: str, config: Fp8GemvConfig, k: int, rows: int) -> None:
    compiled = compiled_ok(
        fp8_block_gemv_kernel,
        arch,
        types=types(fp8_block_gemv_kernel, torch.bfloat16, fp8_inputs=config.prequantize),
        constexprs={
            "K": k,
            "HAS_BIAS": False,
            "M_PAD": rows,
            "BLOCK_N": config.block_n,
            "GROUPS": config.groups,
            "GROUP": GROUP_SIZE,
            "PREQUANTIZED": config.prequantize,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        aligned=aligned(fp8_block_gemv_kernel),
    )
    # The activations' quantization inside, or not.
    assert ("div.rn.f32" in compiled.asm["ptx"]) != config.prequantize


LLAMA_8B_LAYERS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def skinny_cases() -> list:
    """The tuning's choices for Llama-3.1-8B's projections at every padded row count (1, 16: the
    activations quantized inside; 32, 64: beforehand), and per-channel scales at one row, on
    every NVIDIA target; the few-rows launches on sm_90 only."""
    cases = []
    for arch in ARCHS:
        for n, k in LLAMA_8B_LAYERS:
            for rows in (1, 32, 64):
                config = tuning.fp8_skinny_config(arch, rows, n, k)
                cases.append(pytest.param(arch, config, n, k, rows, True, id=f"{n}x{k}-m{rows}-{arch}"))  # fmt: skip
            config = tuning.fp8_skinny_config(arch, 1, n, k)
            cases.append(pytest.param(arch, config, n, k, 1, False, id=f"{n}x{k}-m1-channel-{arch}"))  # fmt: skip
    return cases + few_rows_cases()


def few_rows_cases() -> list:
    """The launches ``bench/fp8_few_rows_gpu.py`` times at 1 to 16 rows (block scales), each
    (launch, K, K steps a split) once: layers that share them share the compiled kernel. On sm_90
    only: ``fp8_block_few_rows_config`` gives them to Hopper alone, and the sweep that chooses
    among them runs there (on sm_100 as well they were 48 compiles, ~90 s of CI's kernel suites,
    of launches that never run)."""
    cases, seen = [], set()
    for n, k in LLAMA_8B_LAYERS:
        for name, config in tuning.fp8_block_few_rows_candidates(n, k).items():
            groups = k // GROUP_SIZE
            split_k = max(d for d in range(1, config.split_k + 1) if groups % d == 0)
            per_step = groups_a_step(config, groups // split_k)
            key = (config.block_n, config.num_warps, config.num_stages, config.quantize, k, split_k)
            key += (per_step, per_step > 1 and config.masked_groups)
            if key not in seen:
                seen.add(key)
                cases.append(pytest.param("sm90", config, n, k, 1, True, id=f"{n}x{k}-m1-{name}-sm90"))  # fmt: skip
    return cases


@pytest.mark.parametrize(("arch", "config", "n", "k", "rows", "block_scales"), skinny_cases())
def test_fp8_skinny(
    arch: str, config: Fp8SkinnyConfig, n: int, k: int, rows: int, block_scales: bool
) -> None:
    quantize = config.quantize and block_scales
    groups = k // GROUP_SIZE
    split_k = max(d for d in range(1, config.split_k + 1) if groups % d == 0)
    per_step = 1 if quantize else groups_a_step(config, groups // split_k)
    compiled = compiled_ok(
        fp8_skinny_kernel,
        arch,
        types=types(fp8_skinny_kernel, torch.bfloat16, fp8_inputs=not quantize),
        constexprs={
            "K": k,
            "BLOCK_SCALES": block_scales,
            "QUANTIZE": quantize,
            "ROUND_IN_SOFTWARE": False,  # what the launcher passes for CUDA tensors
            "HAS_BIAS": False,
            "M_PAD": padded_rows(rows),
            "BLOCK_N": config.block_n,
            "SPLIT_K": split_k,
            "GROUPS_PER_SPLIT": groups // split_k,
            "GROUP": GROUP_SIZE,
            "GROUPS_PER_STEP": per_step,
            "MASKED_GROUPS": per_step > 1 and config.masked_groups,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        aligned=aligned(fp8_skinny_kernel),
    )
    ptx = compiled.asm["ptx"]
    if quantize:
        # Rounded by the cast alone: IEEE division, the round-to-nearest-even conversion, and
        # none of round_to_e4m3's work (its 1.5 * 2**23).
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        assert "0fCB400000" not in ptx
    else:
        assert "div.rn.f32" not in ptx
    if arch == "sm90":
        # The weight streamed into shared memory in 16-byte copies, multiplied there as e4m3 by
        # wgmma (the activations' rows the MMA's N side), never converted on the CUDA cores.
        assert "cp.async.cg.shared.global" in ptx and ", 0x10," in ptx
        assert "wgmma.mma_async.sync.aligned" in ptx and ".e4m3.e4m3" in ptx
        assert k_steps_start_from_zero(compiled.asm["ttgir"])
        if block_scales:
            assert scales_loaded_a_step_ahead(compiled.asm["ttgir"])
    # A split product's last split reads the others' sums past L1 and resets its counter.
    assert ("atom.global.gpu.acq_rel.add" in ptx) == (split_k > 1)
    assert ("ld.global.cg" in ptx) == (split_k > 1)


def gate_up_silu_cases() -> list:
    """The fused gate/up launches of Llama-3.1-8B's gate_up at the row counts the engine fuses
    (the tuning's table at 1 to 16 rows: ``GLU_ENGINE_MAX_ROWS``)."""
    cases, seen = [], set()
    n, k = 28672, 4096
    for rows in (1, 2, 4, 8, 16):
        config = tuning.fp8_block_config("sm90", rows, n, k)
        if not isinstance(config, Fp8SkinnyConfig):
            continue
        fused = glu_config(config, k)
        key = (fused, padded_rows(rows))
        if key not in seen:
            seen.add(key)
            cases.append(pytest.param(fused, rows, id=f"m{rows}-split{fused.split_k}"))
    return cases


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("config", "rows"), gate_up_silu_cases())
def test_fp8_gate_up_silu(arch: str, config: Fp8SkinnyConfig, rows: int) -> None:
    import triton.language as tl

    k, groups = 4096, 4096 // GROUP_SIZE
    kinds = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*fp8e4nv", "counter_ptr": "*i32"}
    kinds |= dict.fromkeys(("x_scale_ptr", "w_scale_ptr", "out_scale_ptr", "partial_ptr"), "*fp32")
    kernel_types = {
        name: kinds.get(name, "*bf16" if name.endswith("_ptr") else "i32")
        for name in fp8_skinny_glu_kernel.arg_names
    }
    compiled = compiled_ok(
        fp8_skinny_glu_kernel,
        arch,
        types=kernel_types,
        constexprs={
            "K": k,
            "ACT_DTYPE": tl.bfloat16,
            "ROUND_IN_SOFTWARE": False,
            "HAS_BIAS": False,
            "M_PAD": padded_rows(rows),
            "SPLIT_K": config.split_k,
            "GROUPS_PER_SPLIT": groups // config.split_k,
            "GROUP": GROUP_SIZE,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        aligned=aligned(fp8_skinny_glu_kernel),
    )
    ptx = compiled.asm["ptx"]
    # down's input rounded to e4m3 by the cast, after an IEEE division for its scale.
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if arch == "sm90":
        assert "cp.async.cg.shared.global" in ptx
        assert "wgmma.mma_async.sync.aligned" in ptx and ".e4m3.e4m3" in ptx
        assert k_steps_start_from_zero(compiled.asm["ttgir"])
    assert ("atom.global.gpu.acq_rel.add" in ptx) == (config.split_k > 1)


def k_steps_start_from_zero(ttgir: str) -> bool:
    """Every wgmma product of the kernel starts from a zero accumulator, so its K step's 128
    products are summed on the tensor cores and the steps in fp32 on the CUDA cores. Hopper's fp8
    MMA adds with about 14 bits (Triton's sm90 default lets it: ``maxNumImpreciseAcc`` 2**30):
    had Triton folded ``acc += part`` (per-channel scales) into the MMA's accumulator, all of K
    would be summed at that precision."""
    zeros = set(re.findall(r"(%[\w.]+) = arith.constant dense<0.000000e\+00>", ttgir))
    accumulators = re.findall(r"ttng.warp_group_dot %[\w.]+, %[\w.]+, (%[\w.]+)", ttgir)
    return bool(accumulators) and all(acc in zeros for acc in accumulators)


def scales_loaded_a_step_ahead(ttgir: str) -> bool:
    """The K loop's block-scale loads (its only plain ``tt.load``s: the weight and activation
    tiles are asynchronous copies) come before its wgmma: issued for the next step, they are in
    flight while this step multiplies, instead of a memory latency waited for after the MMA."""
    loop = ttgir[ttgir.index("scf.for") : ttgir.index("scf.yield")]
    loads = [m.start() for m in re.finditer(r"= tt\.load ", loop)]
    mma = loop.find("ttng.warp_group_dot ")
    return bool(loads) and mma > 0 and max(loads) < mma


def test_tuning_picks_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Block scales without FP8_BLOCK_FEW_ROWS's entries (its own test below): the GEMV at one
    # row, the tiled kernel to 16, the few-rows kernel 17 to 64.
    monkeypatch.setattr(tuning, "FP8_BLOCK_FEW_ROWS", {})
    assert tuning.fp8_block_config("sm90", 1, 4096, 4096) == tuning.fp8_gemv_config(
        "sm90", 4096, 4096
    )
    for rows in (2, 4, 16):
        config = tuning.fp8_block_config("sm90", rows, 4096, 4096)
        assert config == tuning.fp8_gemm_config("sm90", rows, 4096, 4096)
    for rows in (tuning.FP8_BLOCK_SKINNY_MIN_ROWS, 32, 64):
        assert isinstance(tuning.fp8_block_config("sm90", rows, 4096, 4096), Fp8SkinnyConfig)
    # Per-channel scales: the few-rows kernel up to 32 rows.
    for rows in (1, 4, 16, tuning.FP8_SCALED_SKINNY_MAX_ROWS):
        assert isinstance(tuning.fp8_scaled_config("sm90", rows, 4096, 4096), Fp8SkinnyConfig)
    assert tuning.fp8_scaled_config("sm90", 33, 4096, 4096) == tuning.fp8_gemm_config(
        "sm90", 33, 4096, 4096
    )
    assert tuning.fp8_skinny_config("sm90", 16, 4096, 4096).quantize
    assert not tuning.fp8_skinny_config("sm90", 17, 4096, 4096).quantize
    # Narrow layers split K until about three programs a multiprocessor; wide ones do not.
    assert tuning.skinny_split(4096, 4096) == 8
    assert tuning.skinny_split(4096, 14336) == 8
    assert tuning.skinny_split(28672, 4096) == 1
    assert tuning.skinny_split(4096, 256) == 1  # too few K steps to split
    above = tuning.fp8_block_config("sm90", tuning.SKINNY_MAX_ROWS + 1, 4096, 4096)
    assert above == tuning.fp8_gemm_config("sm90", tuning.SKINNY_MAX_ROWS + 1, 4096, 4096)
    assert tuning.fp8_scaled_config("sm90", tuning.SKINNY_MAX_ROWS + 1, 4096, 4096) == above
    assert tuning.fp8_block_config("sm100", 4096, 8192, 8192) == tuning.FP8_GEMM_LARGE
    # Hopper's cuBLAS blockwise scaling from FP8_CUBLAS_MIN_ROWS, the tiled kernel below it.
    assert tuning.fp8_block_config("sm90", 4096, 8192, 8192) == CublasBlockwise(
        tuning.FP8_GEMM_LARGE
    )
    below = tuning.fp8_block_config("sm90", tuning.FP8_CUBLAS_MIN_ROWS - 1, 8192, 8192)
    assert below == tuning.FP8_GEMM_LARGE
    with pytest.raises(ValueError, match="NVIDIA"):
        tuning.fp8_gemm_config("gfx942", 4096, 8192, 8192)


def test_the_few_rows_kernel_switches_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVIK_FP8_SKINNY=0`` (tuning.FP8_SKINNY): the kernels used before the few-rows kernel."""
    monkeypatch.setattr(tuning, "FP8_SKINNY", False)
    for rows in (1, tuning.FP8_GEMV_MAX_ROWS):
        config = tuning.fp8_block_config("sm90", rows, 6144, 4096)
        assert config == tuning.fp8_gemv_config("sm90", 6144, 4096)
    for rows in (tuning.FP8_GEMV_MAX_ROWS + 1, 16, 64):
        config = tuning.fp8_block_config("sm90", rows, 6144, 4096)
        assert config == tuning.fp8_gemm_config("sm90", rows, 6144, 4096)
    for rows in (1, 64):
        config = tuning.fp8_scaled_config("sm90", rows, 6144, 4096)
        assert config == tuning.fp8_gemm_config("sm90", rows, 6144, 4096)


def test_few_rows_table_routes_block_products_of_1_to_16_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``tuning.FP8_BLOCK_FEW_ROWS``: a listed layer's products take the entry of the fewest rows
    at or above theirs (None: the GEMV or the tiled kernel); other layers, other architectures,
    17 rows and more, and ``KVIK_FP8_SKINNY=0`` keep the routing without the table."""
    launch = Fp8SkinnyConfig(128, 8, 4, 5, quantize=False)
    table = {(4096, 4096): {1: launch, 4: None, 16: launch}}
    monkeypatch.setattr(tuning, "FP8_BLOCK_FEW_ROWS", table)
    for rows in (1, 5, 16):
        assert tuning.fp8_block_config("sm90", rows, 4096, 4096) == launch
    for rows in (2, 4):
        config = tuning.fp8_block_config("sm90", rows, 4096, 4096)
        assert config == tuning.fp8_gemm_config("sm90", rows, 4096, 4096)
    assert tuning.fp8_block_config("sm90", 1, 6144, 4096) == tuning.fp8_gemv_config(
        "sm90", 6144, 4096
    )
    assert tuning.fp8_block_config("sm100", 1, 4096, 4096) == tuning.fp8_gemv_config(
        "sm100", 4096, 4096
    )
    assert tuning.fp8_block_config("sm90", 17, 4096, 4096) == tuning.fp8_skinny_config(
        "sm90", 17, 4096, 4096
    )
    monkeypatch.setattr(tuning, "FP8_SKINNY", False)
    assert tuning.fp8_block_config("sm90", 1, 4096, 4096) == tuning.fp8_gemv_config(
        "sm90", 4096, 4096
    )
    assert tuning.fp8_block_config("sm90", 16, 4096, 4096) == tuning.fp8_gemm_config(
        "sm90", 16, 4096, 4096
    )


def test_few_rows_table_lists_only_launches_the_sweep_checked() -> None:
    """Every launch in ``tuning.FP8_BLOCK_FEW_ROWS`` is one the sweep checks and times (a few-rows
    candidate of its layer, or a GEMV candidate at one row), so each is compiled by the cases
    above; a hand edit of the table to an unswept launch fails here."""
    assert tuning.FP8_BLOCK_FEW_ROWS, "the H200 sweep's table is empty"
    gemvs = set(tuning.FP8_GEMV_CANDIDATES.values()) | {
        tuning.fp8_gemv_config("sm90", n, k) for n, k in LLAMA_8B_LAYERS
    }
    for (n, k), by_rows in tuning.FP8_BLOCK_FEW_ROWS.items():
        assert (n, k) in LLAMA_8B_LAYERS
        candidates = set(tuning.fp8_block_few_rows_candidates(n, k).values())
        for rows, launch in by_rows.items():
            assert 1 <= rows < tuning.FP8_BLOCK_SKINNY_MIN_ROWS
            if isinstance(launch, Fp8GemvConfig):
                assert rows == 1 and launch in gemvs, (n, k, rows, launch)
            else:
                assert launch is None or launch in candidates, (n, k, rows, launch)
        if by_rows[min(by_rows)] is not None:  # one row routes to the table's first entry
            assert tuning.fp8_block_config("sm90", 1, n, k) == by_rows[min(by_rows)]


def test_few_rows_candidates_split_narrow_layers_only() -> None:
    """The sweep's launches: the tuning's own among them, split K as the tuning does (narrow
    layers 8 ways, gate_up not), half and twice that, quantizing inside or before."""
    for (n, k), split in {(4096, 14336): 8, (6144, 4096): 8, (28672, 4096): 1}.items():
        candidates = tuning.fp8_block_few_rows_candidates(n, k)
        assert tuning.fp8_skinny_config("sm90", 1, n, k) in candidates.values()
        splits = {max(1, split // 2), split, min(16, 2 * split)}
        assert {c.split_k for c in candidates.values()} == splits
        assert {c.quantize for c in candidates.values()} == {True, False}


def test_the_switch_reads_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, expected in (("", True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv("KVIK_FP8_SKINNY", raw)
        assert tuning.env_switch("KVIK_FP8_SKINNY", default=True) is expected
    monkeypatch.delenv("KVIK_FP8_SKINNY")
    assert tuning.env_switch("KVIK_FP8_SKINNY", default=False) is False
    monkeypatch.setenv("KVIK_FP8_SKINNY", "off")
    with pytest.raises(
        ValueError, match=r"KVIK_FP8_SKINNY must be 1 \(on\) or 0 \(off\), not 'off'"
    ):
        tuning.env_switch("KVIK_FP8_SKINNY", default=True)


#: Qwen3-30B-A3B-FP8's experts (128 of 768 over 2048, top-8) at decode and prefill token counts.
FP8_MOE_TOKENS = [1, 8, 64, 4096]


def moe_aligned(gated: bool, experts: int = 128, inter: int = 768, hidden: int = 2048):
    """The pointers, and the sizes and strides that are multiples of 16 at these shapes (as the
    JIT specializes for them at a launch): the down GEMM's activation scales have 6 groups."""
    n, k = (inter, hidden) if gated else (hidden, inter)
    rows = 2 * inter if gated else hidden
    scale_rows, scale_cols = rows // 128, -(-k // 128)
    sizes = {
        "N": n, "K": k, "stride_am": k, "stride_we": rows * k, "stride_wn": k, "stride_om": n,
        "stride_asm": scale_cols, "stride_wse": scale_rows * scale_cols, "stride_wsn": scale_cols,
    }  # fmt: skip
    pointers = [name for name in moe_gemm_kernel.arg_names if name.endswith("_ptr")]
    return (*pointers, *(name for name, size in sizes.items() if size % 16 == 0))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens", FP8_MOE_TOKENS)
@pytest.mark.parametrize("swap", [False, True], ids=["as-chosen", "swapped"])
def test_fused_moe_fp8_block(arch: str, tokens: int, swap: bool) -> None:
    """The block-FP8 grouped GEMMs (e4m3 operands, fp32 block scales, bf16 out) at the
    configurations kvik_cuda picks, and those computed transposed (swap_ab) where the row
    block is 16-32; on Hopper with fp8 wgmma where the row block (or, swapped, the column
    block) allows it, and swapped never converting the e4m3 weights on the CUDA cores."""
    configs = fused_moe_config(arch, tokens, 128, 768, 2048, 8, torch.float8_e4m3fn)
    if swap:
        if any(c.block_m > 32 or c.block_n % 64 for c in configs):
            pytest.skip("swap_ab needs row blocks of 16-32 and column blocks of 64s")
        configs = tuple(dataclasses.replace(c, swap_ab=1) for c in configs)
    up, down = configs
    signature = types(moe_gemm_kernel, torch.bfloat16) | {
        "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "total_ptr": "*i32",
        "weights_ptr": "*fp32", "ids_ptr": "*i32", "counter_ptr": "*i32",
    }  # fmt: skip
    decode = tokens <= SUM_LAST_MAX_TOKENS
    for config, gated in ((up, True), (down, False)):
        assert 128 % config.block_k == 0  # one scale group a K step
        compiled = compiled_ok(
            moe_gemm_kernel,
            arch,
            types=signature,
            constexprs={
                **step_constexprs(
                    tokens == 1,
                    gated,
                    decode and not gated,
                    decode and gated,
                    8,
                    128,
                    True,
                    tokens,
                ),
                "A_ROW_DIV": 8 if gated else 1,
                "GATED": gated,
                "WEIGHTED": not gated,
                "FP8_BLOCK": True,
                "SWAP_AB": bool(config.swap_ab),
                "PAIRED": bool(gated and config.paired),
                "BLOCK_M": config.block_m,
                "BLOCK_N": config.block_n,
                "BLOCK_K": config.block_k,
                "GROUP_M": config.group_m,
                "HALF_ROWS": bool(config.half_rows) and tokens > 1,
                **even_tiles(*((768, 2048) if gated else (2048, 768)), config),
            },  # fmt: skip
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            aligned=moe_aligned(gated),
        )
        if arch == "sm90":
            assert "cp.async" in compiled.asm["ptx"]  # loads pipelined in the stages asked for
            if config.block_m >= 64:
                # fp8 wgmma, of whatever width the tile splits into among the warpgroups
                fp8_wgmma = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3"
                assert re.search(fp8_wgmma, compiled.asm["ptx"]), set(
                    re.findall(r"wgmma\.mma_async\S*", compiled.asm["ptx"])
                )
            if config.swap_ab:
                wgmma = f"wgmma.mma_async.sync.aligned.m64n{config.block_m}k32.f32.e4m3.e4m3"
                assert wgmma in compiled.asm["ptx"]
                assert "cvt.rn.f16x2.e4m3x2" not in compiled.asm["ptx"]


def test_the_cast_rounds_only_on_nvidia_gpus_from_sm89(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where launches take ROUND_IN_SOFTWARE=False (the variant compiled above without the
    rounding helper): NVIDIA GPUs whose e4m3 cast is cvt.rn.satfinite."""
    from kvik.triton_kernels import fp8_quant

    assert fp8_quant.rounds_in_software(torch.device("cpu"))  # the interpreter
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, software in (
        ((9, 0), False),
        ((10, 0), False),
        ((8, 9), False),
        ((8, 0), True),
    ):
        monkeypatch.setattr(fp8_quant, "cuda_capability", lambda index, c=capability: c)
        assert fp8_quant.rounds_in_software(torch.device("cuda", 0)) == software
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert fp8_quant.rounds_in_software(torch.device("cuda", 0))
