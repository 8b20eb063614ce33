"""The FP8 kernels (kvik.triton_kernels.fp8_*) against PyTorch references written here, on the
device KVIK_KERNEL_DEVICE names, as triton_kernel_cases.py does for the other kernels (not
collected by itself, no ``test_`` prefix): test_kernels_interpreter.py runs it under
``TRITON_INTERPRET=1`` at small shapes, kvik_cuda's test_fp8_kernels_gpu.py on the GPU at full
sizes with kvik_cuda's launch configurations.

Quantization must equal torch's ``(x / s).clamp(-448, 448).to(torch.float8_e4m3fn)`` bit for bit,
scales included; products are compared in float64 with the reference's own quantized operands.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from torch import Tensor

from kvik.triton_kernels.activation import silu_and_mul, silu_and_mul_fp8_group_quant
from kvik.triton_kernels.attention import device_arch
from kvik.triton_kernels.fp8_gemm import Fp8GemmConfig, Fp8GemvConfig, fp8_gemm
from kvik.triton_kernels.fp8_linear import (
    CublasBlockwise,
    cublas_blockwise_takes,
    fp8_block_linear,
    fp8_block_linear_quantized,
    fp8_scaled_linear,
)
from kvik.triton_kernels.fp8_quant import per_token_group_quant_fp8, per_token_quant_fp8
from kvik.triton_kernels.fp8_skinny import SPLIT_COUNTERS, Fp8SkinnyConfig, split_counters
from kvik.triton_kernels.fp8_skinny_glu import fp8_skinny_glu_block_matmul, glu_config
from kvik.triton_kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_fp8_group_quant,
    rms_norm,
    rms_norm_fp8_group_quant,
)

DEVICE = torch.device(os.environ.get("KVIK_KERNEL_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "CPU tensors reach the kernels only under TRITON_INTERPRET=1", allow_module_level=True
    )

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(hash(request.node.name) % 2**31)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(dtype=dtype, device=DEVICE)


def poison_allocator() -> None:
    """Fill freed device memory with NaN, so launcher-allocated outputs start poisoned."""
    if ON_GPU:
        torch.full((1 << 28,), float("nan"), device=DEVICE)
        torch.cuda.synchronize()


# --- references ---------------------------------------------------------------------------------


def ref_quant(x: Tensor, scale: Tensor) -> Tensor:
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def ref_group_quant(x: Tensor, group: int = 128) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q [M, K], scales [M, ceil(K/group)]), on the CPU."""
    x = x.cpu().float()
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group).index_copy_(1, torch.arange(k), x)
    grouped = padded.view(m, groups, group)
    scales = (grouped.abs().amax(dim=-1) / 448.0).clamp(min=1e-10)
    q = ref_quant(grouped, scales[..., None]).view(m, groups * group)[:, :k]
    return q, scales


def ref_token_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    x = x.cpu().float()
    scales = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-10)
    return ref_quant(x, scales), scales


def dequant_blocks(q: Tensor, scales: Tensor, rows_per_scale: int) -> Tensor:
    """q [R, K] with scales [ceil(R/rows_per_scale), ceil(K/128)] -> float64 [R, K] on DEVICE
    (where the float64 products of the full sizes are quick)."""
    r, k = q.shape
    expanded = scales.to(DEVICE, torch.float64).repeat_interleave(rows_per_scale, 0)[:r]
    return q.to(DEVICE).double() * expanded.repeat_interleave(128, 1)[:, :k]


def same_bits(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def check(out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    out, ref = out.cpu().double(), ref.cpu().double()
    assert out.shape == ref.shape
    assert not out.isnan().any(), "unwritten or NaN outputs"
    # Hopper's fp8 tensor cores add a group's 128 products with fewer bits than fp32.
    tolerance = max(TOLERANCE[dtype], 1e-3 if ON_GPU else 0.0)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < tolerance, f"relative error {err:.2e}"


def activations(m: int, k: int, dtype: torch.dtype) -> Tensor:
    """Random rows with a few large outliers, the first row zero where there are several."""
    x = randn(m, k, dtype=torch.float32) * 3
    x[:, :: max(1, k // 7)] *= 50
    if m > 2:
        x[1] = 0
    return x.to(dtype)


def fp8_weight(n: int, k: int) -> Tensor:
    # Drawn on the device: the full sizes' weights are large for the CPU's float64 generator.
    return (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(FP8)


def block_scales(n: int, k: int) -> Tensor:
    return (torch.rand(-(-n // 128), -(-k // 128), dtype=torch.float64) * 1e-3 + 1e-4).float()


# --- configurations -----------------------------------------------------------------------------

if ON_GPU:
    import kvik_cuda.fp8
    from kvik_cuda.tuning import fp8_block_config, fp8_gemm_config

    ARCH = device_arch(DEVICE)[0]

    def block_config(m: int, n: int, k: int) -> Fp8GemmConfig | Fp8GemvConfig | Fp8SkinnyConfig:
        return fp8_block_config(ARCH, m, n, k)

    def gemm_config(m: int, n: int, k: int) -> Fp8GemmConfig:
        return fp8_gemm_config(ARCH, m, n, k)

    def block_linear(
        x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None
    ) -> Tensor:
        """The platform's function, the configuration its own choice."""
        return kvik_cuda.fp8.fp8_block_linear(x, weight, weight_scale, bias)

    # (M, N, K): Llama-3.1-8B's qkv, o, gate_up and down at decode and prefill sizes; edges.
    LINEAR_SHAPES = [
        (1, 6144, 4096),
        (1, 4096, 14336),
        (3, 28672, 4096),
        (16, 4096, 4096),
        (300, 6144, 4096),
        (1000, 4096, 14336),
        (77, 1000, 1500),
    ]
    QUANT_SHAPES = [(1, 4096), (300, 14336), (77, 1500)]
    SCALED_SHAPES = LINEAR_SHAPES[::2]
else:
    # Small tiles keep the interpreter quick; sizes are no multiple of the blocks or of 128.
    GEMV = Fp8GemvConfig(block_n=16, groups=2, max_rows=4, num_warps=1, num_stages=1)
    GEMM = Fp8GemmConfig(block_m=16, block_n=32, group_m=2, num_warps=1, num_stages=1)

    def block_config(m: int, n: int, k: int) -> Fp8GemmConfig | Fp8GemvConfig:
        return GEMV if m <= GEMV.max_rows else GEMM

    def gemm_config(m: int, n: int, k: int) -> Fp8GemmConfig:
        return GEMM

    def block_linear(
        x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None
    ) -> Tensor:
        m, k = x.numel() // x.shape[-1], x.shape[-1]
        config = block_config(m, weight.shape[0], k)
        return fp8_block_linear(x, weight, weight_scale, bias, config)

    LINEAR_SHAPES = [(1, 40, 300), (3, 200, 256), (5, 200, 300), (40, 72, 136)]
    QUANT_SHAPES = [(1, 128), (3, 300), (5, 1100)]
    SCALED_SHAPES = LINEAR_SHAPES


# --- quantization -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), QUANT_SHAPES)
def test_per_token_group_quant_matches_torch_bit_for_bit(
    dtype: torch.dtype, m: int, k: int
) -> None:
    x = activations(m, k, dtype)
    poison_allocator()
    q, scales = per_token_group_quant_fp8(x)
    ref_q, ref_scales = ref_group_quant(x)
    assert q.dtype == FP8 and scales.dtype == torch.float32
    assert scales.shape == (m, -(-k // 128))
    assert torch.equal(scales.cpu(), ref_scales)
    assert same_bits(q, ref_q)
    if m > 2:  # the zero row: the floor scale and zeros, never NaN
        assert torch.equal(q[1].cpu().float(), torch.zeros(k))
        assert torch.equal(scales[1].cpu(), torch.full((scales.shape[1],), 1e-10))


# --- producers that write a projection's quantized input (kvik.quantization.activation) ----------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), QUANT_SHAPES + [(2, 64)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_writes_what_the_group_quantization_of_its_result_gives(
    dtype: torch.dtype, m: int, k: int, residual: bool
) -> None:
    """The norm that quantizes its result gives, bit for bit, the values and scales of the plain
    norm's result quantized by ``per_token_group_quant_fp8`` (a hidden size below one group
    included), and the same residual sum."""
    x, w = activations(m, k, dtype), randn(k, dtype=dtype)
    r = randn(m, k, dtype=dtype) if residual else None
    poison_allocator()
    if r is None:
        values, scales = rms_norm_fp8_group_quant(x, w, 1e-6)
        plain = rms_norm(x, w, 1e-6)
    else:
        values, scales, summed = fused_add_rms_norm_fp8_group_quant(x, r, w, 1e-6)
        plain, plain_summed = fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(summed.cpu(), plain_summed.cpu())
    ref_values, ref_scales = per_token_group_quant_fp8(plain)
    assert values.dtype == FP8 and scales.shape == (m, -(-k // 128))
    assert in_producers_layout(scales)
    assert torch.equal(scales.cpu(), ref_scales.cpu())
    assert same_bits(values, ref_values)


def in_producers_layout(scales: Tensor) -> bool:
    """Tokens contiguous: a [T, groups] view of a [groups, T] tensor (empty_group_scales)."""
    return scales.t().is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "inter"), [(1, 4096), (3, 1500), (2, 100)] if ON_GPU else [(3, 1500), (2, 100)]
)
def test_silu_and_mul_writes_what_the_group_quantization_of_its_result_gives(
    dtype: torch.dtype, m: int, inter: int
) -> None:
    x = activations(m, 2 * inter, dtype)
    poison_allocator()
    values, scales = silu_and_mul_fp8_group_quant(x)
    ref_values, ref_scales = per_token_group_quant_fp8(silu_and_mul(x))
    assert values.shape == (m, inter) and scales.shape == (m, -(-inter // 128))
    assert in_producers_layout(scales)
    assert torch.equal(scales.cpu(), ref_scales.cpu())
    assert same_bits(values, ref_values)


@pytest.mark.parametrize(("m", "n", "k"), LINEAR_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("producers_layout", [False, True])
def test_block_linear_on_quantized_input(
    m: int, n: int, k: int, bias: bool, producers_layout: bool
) -> None:
    """Each kernel the configuration names, given the activations quantized already (scales
    row-major, or tokens contiguous as the producers write them), equals the reference's
    product, and the plain path's bits where that path quantizes by its own launch."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x = activations(m, k, dtype)
    weight, weight_scale = fp8_weight(n, k), block_scales(n, k).to(DEVICE)
    b = randn(n, dtype=dtype) if bias else None
    q, scales = per_token_group_quant_fp8(x, column_major_scales=producers_layout)
    config = block_config(m, n, k)
    poison_allocator()
    out = fp8_block_linear_quantized(q, scales, weight, weight_scale, b, dtype, config)
    assert out.dtype == dtype
    check(out, ref_block_linear(x, weight, weight_scale.cpu(), b), dtype)
    prequantizing = (
        isinstance(config, Fp8GemmConfig)
        or (isinstance(config, Fp8GemvConfig) and config.prequantize)
        or (isinstance(config, Fp8SkinnyConfig) and not config.quantize)
    )
    if prequantizing:
        assert torch.equal(out.cpu(), fp8_block_linear(x, weight, weight_scale, b, config).cpu())


def test_group_quant_keeps_leading_dims_and_writes_column_major_scales() -> None:
    x = activations(6, 300, torch.float32)
    q, scales = per_token_group_quant_fp8(x.view(2, 3, 300))
    assert q.shape == (2, 3, 300) and scales.shape == (2, 3, 3)
    q_cols, scales_cols = per_token_group_quant_fp8(x, column_major_scales=True)
    assert scales_cols.stride() == (1, 6)
    assert torch.equal(scales_cols.cpu(), scales.view(6, 3).cpu())
    assert same_bits(q_cols, q.view(6, 300))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), QUANT_SHAPES)
def test_per_token_quant_dynamic(dtype: torch.dtype, m: int, k: int) -> None:
    x = activations(m, k, dtype)
    poison_allocator()
    q, scales = per_token_quant_fp8(x)
    ref_q, ref_scales = ref_token_quant(x)
    assert scales.shape == (m, 1)
    assert torch.equal(scales.cpu(), ref_scales)
    assert same_bits(q, ref_q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_quant_static_saturates(dtype: torch.dtype) -> None:
    """A static scale: values beyond 448 * scale come out as +-448, the rest round to nearest."""
    m, k = QUANT_SHAPES[1]
    x = activations(m, k, dtype)
    scale = torch.tensor([x.float().abs().max().item() / 448.0 / 4], device=DEVICE)
    poison_allocator()
    q, out_scale = per_token_quant_fp8(x, scale)
    assert out_scale is scale
    assert same_bits(q, ref_quant(x.cpu(), scale.cpu()))
    beyond = x.float().cpu().abs() > 448 * scale.cpu()
    assert beyond.any()
    assert torch.equal(q.cpu().float()[beyond].abs(), torch.full((int(beyond.sum()),), 448.0))


def test_rounding_ties_to_even_and_keeps_signed_zeros() -> None:
    """Every e4m3 value, the midpoints between neighbours (ties), their fp32 neighbours and
    values below the smallest subnormal, through a static scale of 1: as torch's cast."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([
        values, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
        torch.tensor([-0.0, 1e-30, -1e-30, 2.0**-10, -(2.0**-10), 500.0, -1e6]),
    ])  # fmt: skip
    q, _ = per_token_quant_fp8(x.to(DEVICE)[None], torch.ones(1, device=DEVICE))
    assert same_bits(q[0], x.clamp(-448, 448).to(FP8))


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(4, 8, dtype=torch.int32), torch.tensor(1.0)],
    ids=["int", "scalar"],
)
def test_quantization_refuses_bad_activations(bad: Tensor) -> None:
    with pytest.raises(ValueError, match="fp8 quantization takes"):
        per_token_group_quant_fp8(bad.to(DEVICE))


def test_quantization_refuses_bad_arguments() -> None:
    x = activations(2, 256, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        per_token_group_quant_fp8(x, group_size=100)
    with pytest.raises(ValueError, match="static activation scale"):
        per_token_quant_fp8(x, torch.ones(2, device=DEVICE))


# --- block FP8 linear ---------------------------------------------------------------------------


def ref_block_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None
) -> Tensor:
    q, scales = ref_group_quant(x.reshape(-1, x.shape[-1]))
    out = dequant_blocks(q, scales, 1) @ dequant_blocks(weight, weight_scale, 128).T
    if bias is not None:
        out += bias.double()
    return out.view(*x.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), LINEAR_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_block_linear(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    x, weight, weight_scale = activations(m, k, dtype), fp8_weight(n, k), block_scales(n, k)
    b = randn(n, dtype=dtype) if bias else None
    poison_allocator()
    out = block_linear(x, weight, weight_scale.to(DEVICE), b)
    assert out.dtype == dtype
    check(out, ref_block_linear(x, weight, weight_scale, b), dtype)


@pytest.mark.parametrize(("m", "n", "k"), LINEAR_SHAPES[:2])
@pytest.mark.parametrize("prequantize", [False, True])
def test_the_few_rows_kernel_agrees_with_the_tiled_one(
    m: int, n: int, k: int, prequantize: bool
) -> None:
    x, weight, weight_scale = activations(m, k, torch.float32), fp8_weight(n, k), block_scales(n, k)
    weight_scale = weight_scale.to(DEVICE)
    gemv_config = Fp8GemvConfig(
        16, 2, max_rows=8, num_warps=4, num_stages=2, prequantize=prequantize
    )
    few_rows = fp8_block_linear(x, weight, weight_scale, None, gemv_config)
    tiled = fp8_block_linear(x, weight, weight_scale, None, gemm_config(m, n, k))
    check(few_rows, tiled, torch.float32)


def test_tiles_wider_than_a_weight_scale_block() -> None:
    """256-column tiles: two weight-scale blocks a tile, a scale per column."""
    m, n, k = (300, 1000, 1500) if ON_GPU else (20, 300, 300)
    config = Fp8GemmConfig(64 if ON_GPU else 16, 256, 2, 4, 3)
    x, weight, weight_scale = activations(m, k, torch.float16), fp8_weight(n, k), block_scales(n, k)
    out = fp8_block_linear(x, weight, weight_scale.to(DEVICE), None, config)
    check(out, ref_block_linear(x, weight, weight_scale, None), torch.float16)


@pytest.mark.parametrize("rows", [300, 301, 130, 7])
def test_cublas_blockwise_where_it_takes_the_case(rows: int) -> None:
    """cuBLAS's blockwise scaling on the GPU (bf16, N % 128 == 0, K % 512 == 0), the Triton
    fallback elsewhere (here: CPU tensors), the same numbers either way; row counts that are not
    multiples of 4, which cuBLAS refuses, are padded for it."""
    m, n, k = (rows, 6144, 4096) if ON_GPU else (rows % 8 + 1, 256, 512)
    x, weight, weight_scale = (
        activations(m, k, torch.bfloat16),
        fp8_weight(n, k),
        block_scales(n, k),
    )
    weight_scale = weight_scale.to(DEVICE)
    takes = cublas_blockwise_takes(x, weight, weight_scale)
    if ON_GPU and not takes:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    assert takes == ON_GPU
    bias = randn(n, dtype=torch.bfloat16)
    out = fp8_block_linear(x, weight, weight_scale, bias, CublasBlockwise(gemm_config(m, n, k)))
    check(out, ref_block_linear(x, weight, weight_scale.cpu(), bias), torch.bfloat16)


@pytest.mark.parametrize("rows", [300, 301, 130, 7])
@pytest.mark.parametrize("producers_layout", [False, True])
def test_cublas_blockwise_on_quantized_input(rows: int, producers_layout: bool) -> None:
    """The same on activations quantized already, with the scales row-major (copied for cuBLAS,
    which takes them column-major) or in the producers' tokens-contiguous layout (read in place
    where no row is padded): padded rows or not, the reference's product."""
    m, n, k = (rows, 6144, 4096) if ON_GPU else (rows % 8 + 1, 256, 512)
    x, weight = activations(m, k, torch.bfloat16), fp8_weight(n, k)
    weight_scale = block_scales(n, k).to(DEVICE)
    q, scales = per_token_group_quant_fp8(x, column_major_scales=producers_layout)
    poison_allocator()
    config = CublasBlockwise(gemm_config(m, n, k))
    out = fp8_block_linear_quantized(q, scales, weight, weight_scale, None, torch.bfloat16, config)
    check(out, ref_block_linear(x, weight, weight_scale.cpu(), None), torch.bfloat16)


def test_block_linear_keeps_leading_dims() -> None:
    m, n, k = LINEAR_SHAPES[1]
    x, weight, weight_scale = (
        activations(2 * m, k, torch.float16),
        fp8_weight(n, k),
        block_scales(n, k),
    )
    out = fp8_block_linear(
        x.view(2, m, k), weight, weight_scale.to(DEVICE), None, gemm_config(m, n, k)
    )
    assert out.shape == (2, m, n)
    check(out, ref_block_linear(x, weight, weight_scale, None).view(2, m, n), torch.float16)


def test_block_linear_refuses_bad_operands() -> None:
    m, n, k = LINEAR_SHAPES[2]  # [N/128, K/128] not square: transposed scales have another shape
    x, weight, weight_scale = activations(m, k, torch.float32), fp8_weight(n, k), block_scales(n, k)
    weight_scale = weight_scale.to(DEVICE)
    config = gemm_config(m, n, k)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block_linear(x, weight.float(), weight_scale, None, config)
    with pytest.raises(ValueError, match="block weight scales"):
        fp8_block_linear(x, weight, weight_scale.T.contiguous(), None, config)
    with pytest.raises(ValueError, match="bias"):
        fp8_block_linear(x, weight, weight_scale, randn(n + 1), config)
    with pytest.raises(ValueError, match="at most"):
        fp8_block_linear(x, weight, weight_scale, None, Fp8GemvConfig(16, 2, m - 1, 1, 1))


# --- per-tensor / per-channel linear ------------------------------------------------------------


def ref_scaled_linear(
    x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None, bias: Tensor | None
) -> Tensor:
    if input_scale is None:
        q, a_scale = ref_token_quant(x)
    else:
        a_scale = input_scale.cpu()
        q = ref_quant(x.cpu(), a_scale)
    w = weight.double() * weight_scale.double().reshape(-1, 1)
    out = (q.to(DEVICE).double() * a_scale.to(DEVICE).double()) @ w.T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SCALED_SHAPES)
@pytest.mark.parametrize("weight_scales", ["tensor", "channel"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("use_scaled_mm", [True, False] if ON_GPU else [False])
def test_fp8_scaled_linear(
    dtype: torch.dtype,
    m: int,
    n: int,
    k: int,
    weight_scales: str,
    static: bool,
    bias: bool,
    use_scaled_mm: bool,
) -> None:
    x, weight = activations(m, k, dtype), fp8_weight(n, k)
    scale_count = 1 if weight_scales == "tensor" else n
    weight_scale = (torch.rand(scale_count) * 1e-3 + 1e-4).to(DEVICE)
    input_scale = (x.float().abs().max() / 448.0).reshape(1) if static else None
    b = randn(n, dtype=dtype) if bias else None
    poison_allocator()
    out = fp8_scaled_linear(
        x, weight, weight_scale, input_scale, b, gemm_config(m, n, k), use_scaled_mm
    )
    assert out.dtype == dtype
    check(out, ref_scaled_linear(x, weight, weight_scale, input_scale, b), dtype)


def test_fp8_gemm_refuses_bad_scales() -> None:
    m, n, k = LINEAR_SHAPES[2]
    q, weight = activations(m, k, torch.float32).to(FP8), fp8_weight(n, k)
    config = gemm_config(m, n, k)
    ones = torch.ones(m + 1, device=DEVICE)
    with pytest.raises(ValueError, match="activation scales must hold"):
        fp8_gemm(q, weight, ones, ones[:1], None, torch.float32, config, block_scales=False)
    with pytest.raises(ValueError, match="activation scales must be"):
        fp8_gemm(q, weight, ones, block_scales(n, k), None, torch.float32, config, True)
    with pytest.raises(ValueError, match="weight scales must be fp32"):
        fp8_scaled_linear(q.float(), weight, ones.double(), None, None, config)


# --- the few-rows tensor-core kernel (kvik.triton_kernels.fp8_skinny) ---------------------------

if ON_GPU:
    from kvik_cuda.tuning import fp8_skinny_config

    # (M, N, K): Llama-3.1-8B's qkv, down, gate_up and o at decode batch sizes (the tuning's
    # split-K for narrow layers), and an edge shape with a K tail and a partial tile.
    SKINNY_SHAPES = [
        (1, 6144, 4096),
        (4, 4096, 14336),
        (16, 28672, 4096),
        (17, 4096, 4096),
        (64, 6144, 4096),
        (33, 1000, 1500),
    ]

    def skinny_config(m: int, n: int, k: int) -> Fp8SkinnyConfig:
        return fp8_skinny_config(ARCH, m, n, k)

    SKINNY_VARIANTS = [
        Fp8SkinnyConfig(64, 8, 4, 4),
        Fp8SkinnyConfig(256, 2, 8, 3),
        Fp8SkinnyConfig(128, 4, 4, 4, quantize=False),
    ]
    VARIANT_SIZE = (3000, 4096)
    # (M, N, K, dtype, bias) and (M, N, K, weight scales, static activation scale, bias): every
    # combination on the GPU.
    SKINNY_BLOCK_CASES = [
        (*shape, dtype, bias)
        for dtype, shape, bias in itertools.product(DTYPES, SKINNY_SHAPES, [False, True])
    ]
    SKINNY_SCALED_CASES = [
        (*shape, scales, static, bias)
        for shape, scales, static, bias in itertools.product(
            SKINNY_SHAPES[::2], ["tensor", "channel"], [False, True], [False, True]
        )
    ]
else:
    # Sizes that split K (4 groups of 128; 6 with a K tail, in 3 splits whose last holds the
    # tail), tiles narrower and wider than a weight-scale block, rows padded to 16, 32 and 64.
    SKINNY_SHAPES = [(1, 40, 512), (3, 200, 648), (17, 72, 512), (40, 130, 256)]

    def skinny_config(m: int, n: int, k: int) -> Fp8SkinnyConfig:
        return Fp8SkinnyConfig(32, 4, 1, 1, quantize=m <= 16)

    SKINNY_VARIANTS = [
        Fp8SkinnyConfig(16, 2, 1, 1),
        Fp8SkinnyConfig(256, 4, 1, 1),
        Fp8SkinnyConfig(128, 1, 1, 1, quantize=False),
    ]
    VARIANT_SIZE = (160, 512)
    # The interpreter runs every program in Python: each shape once, the dtypes, biases and
    # scale kinds spread over them (seconds in all).
    SKINNY_BLOCK_CASES = [
        (1, 40, 512, torch.float32, False),
        (3, 200, 648, torch.float16, True),
        (17, 72, 512, torch.bfloat16, True),
        (40, 130, 256, torch.float32, False),
    ]
    SKINNY_SCALED_CASES = [
        (1, 40, 512, "channel", False, True),
        (3, 200, 648, "tensor", False, True),
        (17, 72, 512, "tensor", True, False),
        (40, 130, 256, "channel", True, False),
    ]


@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias"), SKINNY_BLOCK_CASES)
def test_skinny_block_linear(m: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    x, weight, weight_scale = activations(m, k, dtype), fp8_weight(n, k), block_scales(n, k)
    b = randn(n, dtype=dtype) if bias else None
    poison_allocator()
    out = fp8_block_linear(x, weight, weight_scale.to(DEVICE), b, skinny_config(m, n, k))
    assert out.dtype == dtype
    check(out, ref_block_linear(x, weight, weight_scale, b), dtype)


@pytest.mark.parametrize(("m", "n", "k", "dtype", "bias"), SKINNY_BLOCK_CASES[1:])
def test_skinny_block_linear_on_the_producers_scales(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool
) -> None:
    """The few-rows kernel on input quantized already reads the scales through both strides:
    tokens contiguous, as the producers write them, the same bits as row-major."""
    x, weight, weight_scale = activations(m, k, dtype), fp8_weight(n, k), block_scales(n, k)
    b = randn(n, dtype=dtype) if bias else None
    config = skinny_config(m, n, k)
    outs = []
    for producers_layout in (False, True):
        q, scales = per_token_group_quant_fp8(x, column_major_scales=producers_layout)
        poison_allocator()
        outs.append(
            fp8_block_linear_quantized(
                q, scales, weight, weight_scale.to(DEVICE), b, dtype, config
            ).cpu()
        )
    check(outs[1], ref_block_linear(x, weight, weight_scale, b), dtype)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("config", SKINNY_VARIANTS, ids=str)
@pytest.mark.parametrize("m", [1, 5, 64] if ON_GPU else [1, 20])
def test_skinny_block_linear_variants(config: Fp8SkinnyConfig, m: int) -> None:
    """Other tilings, splits and quantization choices than the tuning's: the same product."""
    n, k = VARIANT_SIZE
    x, weight, weight_scale = (
        activations(m, k, torch.bfloat16),
        fp8_weight(n, k),
        block_scales(n, k),
    )
    bias = randn(n, dtype=torch.bfloat16)
    poison_allocator()
    out = fp8_block_linear(x, weight, weight_scale.to(DEVICE), bias, config)
    check(out, ref_block_linear(x, weight, weight_scale, bias), torch.bfloat16)


if ON_GPU:
    from kvik_cuda.tuning import fp8_block_few_rows_candidates

    # Llama-3.1-8B's down (split K) and an edge size with a K tail and a partial tile, at every
    # launch the few-rows sweep times.
    FEW_ROWS_CASES = [
        pytest.param(n, k, config, id=f"{n}x{k}-{name}")
        for n, k in [(4096, 14336), (1000, 1500)]
        for name, config in fp8_block_few_rows_candidates(n, k).items()
    ]
    FEW_ROWS_DTYPE = torch.bfloat16
else:
    # N and K no multiples of 128 or of the tiles (3 groups, the last cut short; 3 splits of one
    # group each), the activations quantized inside and before, tiles narrower and wider than a
    # weight-scale block.
    FEW_ROWS_CASES = [
        pytest.param(200, 300, config, id=str(config))
        for config in [
            Fp8SkinnyConfig(16, 1, 1, 1),
            Fp8SkinnyConfig(32, 3, 1, 1, quantize=False),
            Fp8SkinnyConfig(256, 3, 1, 1, quantize=False),
        ]
    ]
    FEW_ROWS_DTYPE = torch.float32


@pytest.mark.parametrize(("n", "k", "config"), FEW_ROWS_CASES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_block_linear_at_1_to_16_rows(m: int, n: int, k: int, config: Fp8SkinnyConfig):
    """The launches for decode batches of 1 to 16 (one padded size): the reference's product,
    and exact zeros for an all-zero row (its scales take the floor, its fp8 values are zero)."""
    x, weight, weight_scale = (
        activations(m, k, FEW_ROWS_DTYPE),
        fp8_weight(n, k),
        block_scales(n, k),
    )
    poison_allocator()
    out = fp8_block_linear(x, weight, weight_scale.to(DEVICE), None, config)
    check(out, ref_block_linear(x, weight, weight_scale, None), FEW_ROWS_DTYPE)
    if m > 2:
        assert not x[1].any() and not out[1].any()


# (N, K, block_n, split_k, groups a step): tiles inside a weight-scale block and wider than one
# (one scale a tile; a scale a row), a K tail (the last group cut short), and a split whose
# groups the step size must divide (8 groups in 2 splits: 4 a split, so 4 and 2 a step).
GROUPS_PER_STEP_CASES = (
    [(4096, 14336, 128, 8, 4), (6144, 4096, 64, 4, 2), (1000, 1500, 256, 1, 4)]
    if ON_GPU
    else [(72, 1000, 32, 1, 4), (200, 1000, 256, 2, 2), (40, 512, 16, 1, 4)]
)


@pytest.mark.parametrize(("n", "k", "block_n", "split_k", "per_step"), GROUPS_PER_STEP_CASES)
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("masked", [False, True], ids=["split", "masked"])
def test_skinny_groups_per_step_sum_as_one_group_a_step(
    m: int, n: int, k: int, block_n: int, split_k: int, per_step: int, masked: bool
) -> None:
    """Several groups a pipeline stage (longer runs of each weight row a stage), split into the
    groups' tiles or multiplied whole with the other groups' activations zeroed, add the same
    scaled products in the same order: the bits of one group a step, block and per-channel
    scales alike, and the reference's product. (On the GPU a masked product's zero features add
    exact zeros; the interpreter's matmul sums the 128 others in another association, so there
    the masked form is held to the last bits of fp32 sums instead.)"""
    x, weight, weight_scale = activations(m, k, torch.float32), fp8_weight(n, k), block_scales(n, k)
    weight_scale = weight_scale.to(DEVICE)
    one = Fp8SkinnyConfig(block_n, split_k, 4, 3, quantize=False)
    several = Fp8SkinnyConfig(
        block_n, split_k, 4, 3, quantize=False, groups_per_step=per_step, masked_groups=masked
    )
    poison_allocator()
    out = fp8_block_linear(x, weight, weight_scale, None, several)
    check(out, ref_block_linear(x, weight, weight_scale.cpu(), None), torch.float32)
    exact = not masked or ON_GPU

    def same_sums(a: Tensor, b: Tensor) -> None:
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())

    same_sums(out, fp8_block_linear(x, weight, weight_scale, None, one))
    channel_scale = (torch.rand(n) * 1e-3 + 1e-4).to(DEVICE)
    scaled = [
        fp8_scaled_linear(x, weight, channel_scale, None, None, config) for config in (one, several)
    ]
    same_sums(scaled[1], scaled[0])
    check(scaled[1], ref_scaled_linear(x, weight, channel_scale, None, None), torch.float32)


def test_skinny_groups_per_step_need_quantized_activations() -> None:
    with pytest.raises(ValueError, match="1, 2 or 4"):
        Fp8SkinnyConfig(128, 1, 4, 3, quantize=False, groups_per_step=3)
    with pytest.raises(ValueError, match="1, 2 or 4"):
        Fp8SkinnyConfig(128, 1, 4, 3, quantize=False, groups_per_step=8)
    with pytest.raises(ValueError, match="quantized first"):
        Fp8SkinnyConfig(128, 1, 4, 3, quantize=True, groups_per_step=2)
    with pytest.raises(ValueError, match="masked_groups needs"):
        Fp8SkinnyConfig(128, 1, 4, 3, quantize=False, masked_groups=True)


@pytest.mark.parametrize(("m", "n", "k", "weight_scales", "static", "bias"), SKINNY_SCALED_CASES)
def test_skinny_scaled_linear(m: int, n: int, k: int, weight_scales: str, static: bool, bias: bool):
    dtype = torch.bfloat16
    x, weight = activations(m, k, dtype), fp8_weight(n, k)
    weight_scale = (torch.rand(1 if weight_scales == "tensor" else n) * 1e-3 + 1e-4).to(DEVICE)
    input_scale = (x.float().abs().max() / 448.0).reshape(1) if static else None
    b = randn(n, dtype=dtype) if bias else None
    poison_allocator()
    out = fp8_scaled_linear(x, weight, weight_scale, input_scale, b, skinny_config(m, n, k))
    assert out.dtype == dtype
    check(out, ref_scaled_linear(x, weight, weight_scale, input_scale, b), dtype)


def test_skinny_split_k_is_deterministic_and_leaves_its_counters_at_zero() -> None:
    """The last split adds the partial sums in split order: equal bits call after call; and
    every launch puts the tile counters it used back to zero."""
    m, n, k = SKINNY_SHAPES[0]
    config = Fp8SkinnyConfig(SKINNY_VARIANTS[0].block_n, 4, SKINNY_VARIANTS[0].num_warps, 2)
    x, weight, weight_scale = activations(m, k, torch.float32), fp8_weight(n, k), block_scales(n, k)
    weight_scale = weight_scale.to(DEVICE)
    first = fp8_block_linear(x, weight, weight_scale, None, config)
    for _ in range(3):
        assert torch.equal(fp8_block_linear(x, weight, weight_scale, None, config), first)
    counters = split_counters(x.device)
    assert counters.shape == (SPLIT_COUNTERS,)
    assert not counters.any()


def test_skinny_agrees_with_the_tiled_kernel() -> None:
    """The same quantized operands and group scaling as the tiled kernel: equal up to the order
    of the fp32 sums."""
    m, n, k = SKINNY_SHAPES[1]
    x, weight, weight_scale = activations(m, k, torch.float32), fp8_weight(n, k), block_scales(n, k)
    weight_scale = weight_scale.to(DEVICE)
    skinny = fp8_block_linear(x, weight, weight_scale, None, skinny_config(m, n, k))
    tiled = fp8_block_linear(x, weight, weight_scale, None, gemm_config(m, n, k))
    check(skinny, tiled, torch.float32)


def test_skinny_refuses_bad_operands() -> None:
    m, n, k = SKINNY_SHAPES[1]
    x, weight, weight_scale = (
        activations(65, k, torch.float32),
        fp8_weight(n, k),
        block_scales(n, k),
    )
    config = skinny_config(m, n, k)
    with pytest.raises(ValueError, match="at most 64 rows"):
        fp8_block_linear(x, weight, weight_scale.to(DEVICE), None, config)
    with pytest.raises(ValueError, match="block weight scales"):
        fp8_block_linear(x[:m], weight, weight_scale.T.contiguous().to(DEVICE), None, config)
    with pytest.raises(ValueError, match="weight scales must hold"):
        fp8_scaled_linear(x[:m], weight, torch.ones(n + 1, device=DEVICE), None, None, config)
    with pytest.raises(ValueError, match="block_n"):
        Fp8SkinnyConfig(48, 1, 4, 4)
    with pytest.raises(ValueError, match="split_k"):
        Fp8SkinnyConfig(128, 0, 4, 4)


# --- the gate/up product ending in SiLU-and-mul (kvik.triton_kernels.fp8_skinny_glu) -----------

if ON_GPU:
    # (M, I, K, split): Llama-3.1-8B's gate/up at decode batch sizes, and a K tail.
    GLU_CASES = [(1, 14336, 4096, 2), (4, 14336, 4096, 4), (16, 14336, 4096, 2), (33, 384, 1500, 3)]
    GLU_WARPS, GLU_STAGES = 4, 3
else:
    # Rows padded to 16, 32 and 64; K split into equal runs, one with a tail of 8.
    GLU_CASES = [(1, 256, 512, 2), (3, 384, 648, 3), (17, 128, 256, 1), (40, 128, 384, 3)]
    GLU_WARPS, GLU_STAGES = 1, 1


def check_e4m3(values: Tensor, scales: Tensor, expected: Tensor) -> None:
    """Group-quantized values near ``expected``: e4m3 keeps 3 mantissa bits, so each value is
    off by up to 1/16 of itself (~3% over a tensor); a wrong product is off by its own size."""
    got = values.cpu().double() * scales.cpu().double().repeat_interleave(128, 1)
    expected = expected.cpu().double()
    assert not got.isnan().any()
    err = ((got - expected).norm() / expected.norm()).item()
    assert err < 0.05, f"relative error {err:.2e}"


def unfused_gate_up_silu(q, scales, weight, weight_scale, bias, dtype, config):
    """The two launches the fused product replaces: the product, then SiLU-and-mul's."""
    gate_up = fp8_block_linear_quantized(q, scales, weight, weight_scale, bias, dtype, config)
    return silu_and_mul_fp8_group_quant(gate_up)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "inter", "k", "split"), GLU_CASES)
def test_gate_up_silu_writes_the_two_launches_bits(
    m: int, inter: int, k: int, split: int, bias: bool
) -> None:
    """Down's input from the fused product equals, bit for bit, the few-rows product with the
    same 128-row tiles and splits followed by SiLU-and-mul's quantizing launch (scales in the
    producers' layout); the split counters end at zero; the values are the reference's."""
    # bf16 on the CPU too: the roundings to the activations' dtype are what the test must see.
    dtype = torch.bfloat16
    x = activations(m, k, dtype)
    weight, weight_scale = fp8_weight(2 * inter, k), block_scales(2 * inter, k).to(DEVICE)
    b = randn(2 * inter, dtype=dtype) if bias else None
    q, scales = per_token_group_quant_fp8(x, column_major_scales=True)
    config = Fp8SkinnyConfig(128, split, GLU_WARPS, GLU_STAGES, quantize=False)
    poison_allocator()
    values, out_scales = fp8_skinny_glu_block_matmul(
        q, scales, weight, weight_scale, b, dtype, config
    )
    ref_values, ref_scales = unfused_gate_up_silu(q, scales, weight, weight_scale, b, dtype, config)
    assert values.shape == (m, inter) and out_scales.shape == (m, inter // 128)
    assert in_producers_layout(out_scales)
    assert torch.equal(out_scales.cpu(), ref_scales.cpu())
    assert same_bits(values, ref_values)
    assert not split_counters(x.device).any()
    # Against PyTorch: the product in float64, then SiLU-and-mul (dequantized; e4m3's rounding).
    y = ref_block_linear(x, weight, weight_scale.cpu(), b).double()
    expected = (torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]).to(dtype)
    check_e4m3(values, out_scales, expected)


def test_gate_up_silu_refuses_what_it_cannot_fuse() -> None:
    k = 256
    q, scales = per_token_group_quant_fp8(activations(2, k, torch.float32))
    config = Fp8SkinnyConfig(128, 1, GLU_WARPS, GLU_STAGES, quantize=False)
    for rows in (200, 2 * 128 + 1):  # I not a multiple of 128; an odd number of rows
        weight, weight_scale = fp8_weight(rows, k), block_scales(rows, k).to(DEVICE)
        with pytest.raises(ValueError, match="multiple of 128"):
            fp8_skinny_glu_block_matmul(
                q, scales, weight, weight_scale, None, torch.float32, config
            )
    weight, weight_scale = fp8_weight(256, k), block_scales(256, k).to(DEVICE)
    with pytest.raises(ValueError, match="tiles are 128 rows"):
        fp8_skinny_glu_block_matmul(
            q, scales, weight, weight_scale, None, torch.float32, Fp8SkinnyConfig(64, 1, 1, 1)
        )
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_skinny_glu_block_matmul(
            activations(2, k, torch.float32), scales, weight, weight_scale, None,
            torch.float32, config,
        )  # fmt: skip


def test_gate_up_silu_config_keeps_the_programs_and_their_bytes() -> None:
    """``glu_config``: 256 weight rows a program, so K splits 2x (128-row tiles) or 4x (64-row)
    more ways, in about half the stages."""
    assert glu_config(Fp8SkinnyConfig(128, 1, 4, 4, quantize=False), 4096) == Fp8SkinnyConfig(
        128, 2, 4, 2, quantize=False
    )
    assert glu_config(Fp8SkinnyConfig(64, 1, 4, 4, quantize=False), 4096).split_k == 4
    assert glu_config(Fp8SkinnyConfig(64, 4, 4, 3, quantize=False), 4096).split_k == 16
    assert glu_config(Fp8SkinnyConfig(128, 4, 4, 4, quantize=False), 384).split_k == 3


if ON_GPU:

    @pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17, 64, 65])
    def test_the_platform_gate_up_silu_op(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
        """kvik_cuda's op on Llama-3.1-8B's gate/up: the fused launch with the tuned programs
        where the few-rows kernel takes the rows, up to 16 (bits of the two launches with the
        same tiling), the two launches the tuning picks elsewhere; both near the reference."""
        import kvik_cuda.fp8
        import kvik_cuda.tuning
        from kvik.triton_kernels.fp8_skinny_glu import GLU_ENGINE_MAX_ROWS
        from kvik.triton_kernels.fp8_skinny_glu import glu_config as platform_glu_config
        from kvik_cuda.tuning import fp8_block_config

        fused_calls = []

        def counted(*args):
            fused_calls.append(args[-1])
            return fp8_skinny_glu_block_matmul(*args)

        monkeypatch.setattr(kvik_cuda.fp8, "fp8_skinny_glu_block_matmul", counted)
        # The fused launch is off by default (slower than the two on the H100); the op under test.
        monkeypatch.setattr(kvik_cuda.tuning, "FP8_GATE_UP_SILU", True)
        inter, k, dtype = 14336, 4096, torch.bfloat16
        x = activations(m, k, dtype)
        weight, weight_scale = fp8_weight(2 * inter, k), block_scales(2 * inter, k).to(DEVICE)
        q, scales = per_token_group_quant_fp8(x, column_major_scales=True)
        values, out_scales = kvik_cuda.fp8.fp8_block_silu_and_mul_quantized(
            q, scales, weight, weight_scale, None, dtype
        )
        config = fp8_block_config(ARCH, m, 2 * inter, k)
        fused = isinstance(config, Fp8SkinnyConfig) and m <= GLU_ENGINE_MAX_ROWS
        if fused:
            config = platform_glu_config(config, k)
        assert fused_calls == ([config] if fused else [])
        if ARCH == "sm90" and m == 1:
            assert fused, "one row of Llama's gate/up takes the fused launch on Hopper"
        ref_values, ref_scales = unfused_gate_up_silu(
            q, scales, weight, weight_scale, None, dtype, config
        )
        assert same_bits(values, ref_values) and torch.equal(out_scales, ref_scales)
        y = ref_block_linear(x, weight, weight_scale.cpu(), None).double()
        expected = (torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]).to(dtype)
        check_e4m3(values, out_scales, expected)
