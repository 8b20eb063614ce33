"""The paged KV cache write: key/value [T, Hk, D] into kv_cache [2, num_blocks, block_size, Hk, D]
at slot_mapping [T] (block_id * block_size + offset; negative = padding, skipped). Reference:
``kvik.ops.reshape_and_cache``.

An FP8 cache (``torch.float8_e4m3fn``) stores key / k_scale and value / v_scale, clamped to ±448
and rounded to the nearest e4m3 value, ties to even (kvik.attention.kv_quant). The scales are
read through pointers (device tensors, so a captured CUDA graph replays with the layer's own), and
``KV_FP8`` is a constexpr: a cache of the model's dtype compiles to the plain copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.launch import FastLauncher

#: e4m3's largest finite value (a constexpr, so that kernels may read it).
FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def quantize_e4m3(x, scale):
    """fp32 ``x / scale`` (IEEE division), clamped to ±448 and rounded to the nearest e4m3 value
    (ties to even), as an fp32 holding that value exactly.

    The rounding is done here, in integer and fp32 arithmetic, rather than left to the cast to
    fp8: the value is then exact, and every cast of it gives the same e4m3 bits. (Triton 3.6's
    interpreter, which the CPU tests run, rounds casts to fp8 wrongly; the GPU's cast rounds to
    nearest even, so the two agree.)"""
    y = tl.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    magnitude = tl.abs(y)
    # e4m3 has 3 mantissa bits: the spacing of its values near |y| is 2^(exponent - 3), and
    # below 2^-6 (subnormals) a constant 2^-9.
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    # |y| / spacing < 16: adding and subtracting 1.5 * 2^23 rounds it to an integer, ties to
    # even (fp32 has no bits below the units there). Multiplying by powers of two is exact.
    units = magnitude * inverse
    units = (units + 12582912.0) - 12582912.0
    rounded = (units * spacing).to(tl.int32, bitcast=True) | sign  # -0.0 stays -0.0, as torch
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_stride,
    value_stride,
    head_stride_k,
    head_stride_v,
    half_cache,
    HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < HEADS) & (d < HEAD_SIZE)
    # A slot's [Hk, D] rows are contiguous in the cache; keys and values are half_cache apart.
    dst = cache_ptr + slot * (HEADS * HEAD_SIZE) + h * HEAD_SIZE + d
    k = tl.load(key_ptr + token * key_stride + h * head_stride_k + d, mask=mask)
    v = tl.load(value_ptr + token * value_stride + h * head_stride_v + d, mask=mask)
    if KV_FP8:
        k = quantize_e4m3(k.to(tl.float32), tl.load(k_scale_ptr))
        v = quantize_e4m3(v.to(tl.float32), tl.load(v_scale_ptr))
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half_cache, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_config(heads: int, head_size: int) -> tuple[dict[str, int], int]:
    """(constexprs, num_warps): one token's [Hk, D] per program, about 16 bytes per thread."""
    heads_pad, head_pad = triton.next_power_of_2(heads), triton.next_power_of_2(head_size)
    constexprs = {
        "HEADS": heads,
        "HEAD_SIZE": head_size,
        "HEADS_PAD": heads_pad,
        "HEAD_PAD": head_pad,
    }
    return constexprs, min(max(heads_pad * head_pad // 512, 1), 8)


# Launched once a layer from Python in a step that is not one captured graph (no fused rotary).
_launch_reshape_and_cache = FastLauncher(reshape_and_cache_kernel)


def kv_scale_pointers(
    kv_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None
) -> tuple[bool, Tensor, Tensor]:
    """(whether the cache is FP8, the k and v scale tensors to pass): an FP8 cache needs both
    (one fp32 element each, on the cache's device); another cache ignores them, and the kernel
    gets the cache itself in their place (never read)."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return False, kv_cache, kv_cache
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"an fp8 KV cache needs {name} as one float32 element, got {scale!r}")
        if scale.device.type != kv_cache.device.type:
            raise ValueError(f"{name} is on {scale.device}, the KV cache on {kv_cache.device}")
    return True, k_scale, v_scale


def reshape_and_cache(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """key/value [T, Hk, D] with the last dim contiguous; kv_cache contiguous; k_scale and
    v_scale (fp32 scalars) for an FP8 cache."""
    t, heads, head_size = key.shape
    assert kv_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1
    fp8, k_scale, v_scale = kv_scale_pointers(kv_cache, k_scale, v_scale)
    if t == 0:
        return
    constexprs, num_warps = reshape_and_cache_config(heads, head_size)
    _launch_reshape_and_cache(
        (t,),
        (
            key, value, kv_cache, slot_mapping, k_scale, v_scale, key.stride(0), value.stride(0),
            key.stride(1), value.stride(1), kv_cache.numel() // 2,
        ),
        {**constexprs, "KV_FP8": fp8}, num_warps=num_warps,
    )  # fmt: skip
