"""Quantizing activations to fp8 e4m3: per token group (block FP8, groups of 128 input
features), per token (one dynamic scale a row) and per tensor (a static scale given).

Numerics, shared with the PyTorch references (issue 14's contract):
``q = e4m3(clamp(x / s, -448, 448))`` rounded to nearest, ties to even, as
``x.to(torch.float8_e4m3fn)`` rounds; a dynamic scale is ``max(|x|) / 448`` over the group or row in
fp32, at least 1e-10 so that an all-zero row quantizes to zeros. The division is IEEE (``div_rn``),
not the GPU's approximate one, so the kernels and a torch reference agree bit for bit.

The rounding is written out (``round_to_e4m3``) rather than left to the fp32 -> fp8 cast: the
compiled cast rounds to nearest even (``cvt.rn.satfinite.e4m3x2.f32`` on sm90), but the Triton 3.6
interpreter's rounds half up, ignores the bits below the first dropped one and truncates
subnormals. After ``round_to_e4m3`` every value is exactly representable, so both casts agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.pdl import cuda_capability, uses_pdl, wait_for_prior_kernel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: A dynamic scale's lower bound: an all-zero group gets this scale and quantizes to zeros.
SCALE_FLOOR = 1e-10
#: Input features per activation scale (and per weight-scale block) in block FP8.
GROUP_SIZE = 128
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)
# 1.5 * 2**23: adding it to an fp32 of magnitude below 2**22 rounds away the fraction, to nearest
# even (IEEE's default), and subtracting it again is exact.
_ROUNDING_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_to_e4m3(x):
    """fp32 ``x`` in [-448, 448] -> the nearest e4m3 value (ties to even), still as fp32.

    e4m3 has 3 fraction bits and a smallest normal exponent of -6 (subnormals step by 2**-9), so
    the spacing of the values around ``x`` is 2**(max(exponent(x), -6) - 3), a power of two:
    scaling by it is exact, and the scaled value is rounded to an integer."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127  # -127 for zero and fp32 subnormals: the floor holds
    step_exponent = tl.maximum(exponent, -6) - 3
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(x) * inverse_step  # < 16
    magnitude = ((steps + _ROUNDING_MAGIC) - _ROUNDING_MAGIC) * step
    # The sign goes back on as a bit, so that what rounds to zero keeps it (-0.0, as torch's cast).
    sign = (bits >> 31) << 31
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_to_grid(x, scale):
    """fp32 ``x`` over ``scale`` (broadcast) -> e4m3 values as fp32: cast them with ``.to``."""
    scaled = tl.math.div_rn(x, scale)
    return round_to_e4m3(tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX))


@triton.jit
def scale_for_cast(x, scale):
    """fp32 ``x`` over ``scale`` (broadcast), clamped to e4m3's range but not rounded: for a
    compiled kernel's ``.to`` e4m3, which rounds to nearest even itself (``cvt.rn.satfinite`` on
    sm89 and later), giving ``quantize_to_grid``'s values for about half its work an element. Not
    under the interpreter, whose cast rounds otherwise (the module's doc)."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)


@triton.jit
def quantize_for_cast(x, scale, ROUND_IN_SOFTWARE: tl.constexpr):
    """``quantize_to_grid`` where the cast that follows does not round to nearest even (the
    interpreter; GPUs without a rounding e4m3 conversion), else ``scale_for_cast``: the same e4m3
    values after ``.to``, for about half the instructions an element."""
    if ROUND_IN_SOFTWARE:
        return quantize_to_grid(x, scale)
    else:
        return scale_for_cast(x, scale)


def rounds_in_software(device: torch.device) -> bool:
    """A launch's ROUND_IN_SOFTWARE: True unless ``device`` is an NVIDIA GPU of sm_89 or later,
    whose compiled cast is ``cvt.rn.satfinite`` (nearest even, saturating). CPU tensors reach the
    kernels only under the interpreter; AMD's e4m3 conversions are not assumed to round so."""
    if device.type != "cuda" or torch.version.hip is not None:
        return True
    return cuda_capability(device.index) < (8, 9)


@triton.jit
def dynamic_scale(amax):
    """The scale of a group or row whose largest magnitude is ``amax`` (fp32)."""
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _SCALE_FLOOR)


@triton.jit
def store_group_quantized(
    y, q_row_ptr, scale_row_ptr, scale_group_stride, first_group, K, GROUPS: tl.constexpr,
    GROUP: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr,
):  # fmt: skip
    """One token's features ``y`` (fp32 [GROUPS * GROUP], from column ``first_group * GROUP``,
    zeros past K) quantized per group as ``per_token_group_quant_kernel`` does: the e4m3 values
    stored at ``q_row_ptr`` + column, the scales at ``scale_row_ptr`` + group *
    ``scale_group_stride`` (the producers' layout, ``empty_group_scales``: the number of rows).
    For kernels that produce a linear layer's input and quantize it as they write it
    (kvik.quantization.activation)."""
    groups = tl.reshape(y, [GROUPS, GROUP])
    scale = dynamic_scale(tl.max(tl.abs(groups), axis=1))
    q = quantize_for_cast(groups, scale[:, None], ROUND_IN_SOFTWARE)
    group = first_group + tl.arange(0, GROUPS)
    col = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(q_row_ptr + col, q.to(q_row_ptr.dtype.element_ty), mask=col < K)
    tl.store(scale_row_ptr + group * scale_group_stride, scale, mask=group * GROUP < K)


@triton.jit
def per_token_group_quant_kernel(
    x_ptr,  # [M, K], K contiguous
    q_ptr,  # [M, K] e4m3, K contiguous
    scale_ptr,  # [M, ceil(K / GROUP)] fp32, either order
    K,
    x_stride,
    q_stride,
    scale_row_stride,
    scale_group_stride,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    col = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS_PER_PROGRAM, GROUP]
    valid = col < K  # a last group cut short by K reads zeros, which leave its maximum alone
    x = tl.load(x_ptr + row * x_stride + col, mask=valid, other=0.0).to(tl.float32)
    scale = dynamic_scale(tl.max(tl.abs(x), axis=1))
    q = quantize_for_cast(x, scale[:, None], ROUND_IN_SOFTWARE)
    tl.store(q_ptr + row * q_stride + col, q.to(q_ptr.dtype.element_ty), mask=valid)
    scale_ptrs = scale_ptr + row * scale_row_stride + group * scale_group_stride
    tl.store(scale_ptrs, scale, mask=group * GROUP < K)


@triton.jit
def per_token_quant_kernel(
    x_ptr,  # [M, K], K contiguous
    q_ptr,  # [M, K] e4m3, K contiguous
    scale_ptr,  # STATIC_SCALE: [1] fp32, read; else [M] fp32 (a [M, 1] tensor), written
    x_stride,
    q_stride,
    K: tl.constexpr,  # a layer's constant
    STATIC_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    if STATIC_SCALE:
        # No pass over the row first: a program quantizes one block (grid axis 1).
        col = tl.program_id(1) * BLOCK + offsets
        x = tl.load(x_ptr + row * x_stride + col, mask=col < K, other=0.0).to(tl.float32)
        q = quantize_for_cast(x, tl.load(scale_ptr), ROUND_IN_SOFTWARE)
        tl.store(q_ptr + row * q_stride + col, q.to(q_ptr.dtype.element_ty), mask=col < K)
    else:
        # The scale is the row's maximum: a program owns the row and reads it twice (from L2).
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            col = k0 + offsets
            x = tl.load(x_ptr + row * x_stride + col, mask=col < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = dynamic_scale(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            col = k0 + offsets
            x = tl.load(x_ptr + row * x_stride + col, mask=col < K, other=0.0).to(tl.float32)
            q = quantize_for_cast(x, scale, ROUND_IN_SOFTWARE)
            tl.store(q_ptr + row * q_stride + col, q.to(q_ptr.dtype.element_ty), mask=col < K)


#: Groups of 128 a program of the group quantization takes: 1024 elements, 4 warps.
GROUP_QUANT_GROUPS_PER_PROGRAM = 8
GROUP_QUANT_WARPS = 4
#: Elements a step of the per-token quantization takes, and its warps.
TOKEN_QUANT_BLOCK = 1024
TOKEN_QUANT_WARPS = 4


def empty_group_scales(rows: int, groups: int, device: torch.device) -> Tensor:
    """fp32 scales for ``rows`` tokens' ``groups`` groups in the layout the activations' producers
    write them (kvik.quantization.activation): an [rows, groups] view of a [groups, rows] tensor,
    tokens contiguous. cuBLAS's blockwise-scaled products read that layout as it is (rows in
    fours), where row-major scales took a transposing copy before each product; kvik's Triton
    products read either layout through both strides. One row's scales are contiguous either way."""
    return torch.empty(groups, rows, dtype=torch.float32, device=device).t()


def as_rows(x: Tensor) -> Tensor:
    """``x [..., K]`` as ``[M, K]`` with contiguous rows, or a ValueError saying what is wrong."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"fp8 quantization takes bf16, fp16 or fp32 activations, not {x.dtype}")
    if x.dim() == 0:
        raise ValueError("fp8 quantization takes activations of shape [..., K], not a scalar")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def per_token_group_quant_fp8(
    x: Tensor, group_size: int = GROUP_SIZE, column_major_scales: bool = False
) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (q e4m3 [..., K], scales fp32 [..., ceil(K / group_size)]): each run of
    ``group_size`` consecutive features of a token gets its own dynamic scale.

    ``column_major_scales``: the scales in the producers' layout (``empty_group_scales``: tokens
    contiguous), the one cuBLAS's blockwise-scaled products take."""
    if group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"the quantization group size must be a power of two, not {group_size}")
    rows = as_rows(x)
    m, k = rows.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        scales = empty_group_scales(m, groups, x.device)
    else:
        scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    per_group = min(GROUP_QUANT_GROUPS_PER_PROGRAM, triton.next_power_of_2(groups))
    if m > 0 and k > 0:
        pdl = uses_pdl(x.device)
        per_token_group_quant_kernel[(m, triton.cdiv(groups, per_group))](
            rows, q, scales, k, rows.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
            GROUP=group_size, GROUPS_PER_PROGRAM=per_group,
            ROUND_IN_SOFTWARE=rounds_in_software(x.device), PDL=pdl, num_warps=GROUP_QUANT_WARPS,
            launch_pdl=pdl,
        )  # fmt: skip
    return q.view(*x.shape), scales.view(*x.shape[:-1], groups)


def per_token_quant_fp8(x: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (q e4m3 [..., K], scale fp32). With ``scale`` None each token gets its own
    dynamic scale (returned as [..., 1]); else ``scale`` (fp32, one element: a static per-tensor
    scale) is used for every element and returned as given."""
    rows = as_rows(x)
    m, k = rows.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if scale is None:
        out_scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        grid = (m, 1)
    else:
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(
                "a static activation scale is one fp32 element, "
                f"not {scale.dtype} of shape {tuple(scale.shape)}"
            )
        out_scale = scale
        grid = (m, triton.cdiv(k, TOKEN_QUANT_BLOCK))
    if m > 0 and k > 0:
        per_token_quant_kernel[grid](
            rows, q, out_scale, rows.stride(0), q.stride(0), K=k, STATIC_SCALE=scale is not None,
            BLOCK=TOKEN_QUANT_BLOCK, ROUND_IN_SOFTWARE=rounds_in_software(x.device),
            num_warps=TOKEN_QUANT_WARPS,
        )  # fmt: skip
    if scale is None:
        out_scale = out_scale.view(*x.shape[:-1], 1)
    return q.view(*x.shape), out_scale
