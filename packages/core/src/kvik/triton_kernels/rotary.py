"""Rotary position embedding for query and key in one launch, one program per token; and the same
rotation fused with the paged KV cache write (``rotary_and_cache``), which the attention backend
uses so that a layer's new keys are rotated on their way into the cache.

References: ``kvik.ops.rotary_embedding`` (then ``kvik.ops.reshape_and_cache``). ``cos_sin_cache`` [max_position, rot_dim] (fp32, cos then
sin) already carries any frequency scaling (llama3), so the kernel only looks rows up. Into an FP8
cache the rotated keys are rounded to the keys' dtype first, as the reference's rotation returns
them, and then quantized as ``kv_cache.reshape_and_cache`` does.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik.triton_kernels.kv_cache import kv_scale_pointers, quantize_e4m3
from kvik.triton_kernels.launch import FastLauncher
from kvik.triton_kernels.pdl import uses_pdl, wait_for_prior_kernel

if TYPE_CHECKING:
    from kvik.layers.rotary import HeadNorms


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    cos,
    sin,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    dst_scale=1.0,
    TO_FP8: tl.constexpr = False,
    norm_w_ptr=None,
    norm_eps=0.0,
    HEAD_NORM: tl.constexpr = False,
    HEAD_PAD: tl.constexpr = 1,
):
    # cos, sin: [1, HALF_PAD]; this token's heads as [HEADS_PAD, HALF_PAD] pairs (x1, x2). With
    # TO_FP8, dst is an FP8 cache: each result is rounded to src's dtype, then quantized with
    # dst_scale. With HEAD_NORM, each head is first RMS-normalised over its HEAD_SIZE and scaled
    # by norm_w_ptr's [HEAD_SIZE] weight, rounded as the RMSNorm kernel rounds (Qwen3's q/k norms).
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (i < HALF)
    if IS_NEOX:
        d1, d2 = i, i + HALF  # dim i pairs with i + rot_dim / 2
    else:
        d1, d2 = 2 * i, 2 * i + 1  # adjacent dims pair (GPT-J)
    src_ty = src_ptr.dtype.element_ty
    x1 = tl.load(src_ptr + h * HEAD_SIZE + d1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + h * HEAD_SIZE + d2, mask=mask, other=0.0).to(tl.float32)
    if HEAD_NORM:
        # The whole head's sum of squares (the tail past rot_dim included), then each element as
        # kvik's RMSNorm gives it: (x * rstd) rounded to the input dtype, times the weight,
        # rounded again.
        d = tl.arange(0, HEAD_PAD)[None, :]
        whole = tl.load(src_ptr + h * HEAD_SIZE + d, mask=(h < HEADS) & (d < HEAD_SIZE), other=0.0)
        whole = whole.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(whole * whole, axis=1) / HEAD_SIZE + norm_eps)[:, None]
        w1 = tl.load(norm_w_ptr + d1, mask=i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + d2, mask=i < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd).to(src_ty).to(tl.float32)).to(src_ty).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(src_ty).to(tl.float32)).to(src_ty).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if TO_FP8:
        o1 = quantize_e4m3(o1.to(src_ty).to(tl.float32), dst_scale)
        o2 = quantize_e4m3(o2.to(src_ty).to(tl.float32), dst_scale)
    tl.store(dst_ptr + h * HEAD_SIZE + d1, o1.to(ty), mask=mask)
    tl.store(dst_ptr + h * HEAD_SIZE + d2, o2.to(ty), mask=mask)
    if TAIL_PAD > 0:
        # Dims past rot_dim pass through unchanged.
        j = 2 * HALF + tl.arange(0, TAIL_PAD)[None, :]
        tail_mask = (h < HEADS) & (j < HEAD_SIZE)
        tail = tl.load(src_ptr + h * HEAD_SIZE + j, mask=tail_mask)
        if HEAD_NORM:
            w_tail = tl.load(norm_w_ptr + j, mask=j < HEAD_SIZE, other=0.0).to(tl.float32)
            normed = (tail.to(tl.float32) * rstd).to(src_ty).to(tl.float32)
            tail = (w_tail * normed).to(src_ty)
        if TO_FP8:
            tail = quantize_e4m3(tail.to(tl.float32), dst_scale).to(ty)
        tl.store(dst_ptr + h * HEAD_SIZE + j, tail, mask=tail_mask)


@triton.jit
def _cos_sin(
    positions_ptr, cos_sin_ptr, cos_sin_stride, token, HALF: tl.constexpr, HALF_PAD: tl.constexpr
):
    # This token's row of the table, as [1, HALF_PAD] cos and sin (zero past HALF).
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + i, mask=i < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + i, mask=i < HALF, other=0.0)
    return cos, sin


@triton.jit
def rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    q_stride,
    k_stride,
    cache_stride,
    NUM_HEADS: tl.constexpr,
    NUM_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, cache_ptr, cache_stride, token, HALF, HALF_PAD)
    _rotate_heads(
        q_ptr + token * q_stride, q_out_ptr + token * NUM_HEADS * HEAD_SIZE, cos, sin,
        NUM_HEADS, NUM_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, TAIL_PAD, IS_NEOX,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * k_stride, k_out_ptr + token * NUM_KV_HEADS * HEAD_SIZE, cos, sin,
        NUM_KV_HEADS, NUM_KV_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, TAIL_PAD, IS_NEOX,
    )  # fmt: skip


@triton.jit
def rotary_and_cache_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    kv_cache_ptr,
    slot_ptr,
    cos_sin_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_norm_ptr,  # HEAD_NORM: [HEAD_SIZE] weights; else unused
    k_norm_ptr,
    q_stride,
    k_stride,
    v_stride,
    cos_sin_stride,
    half_cache,
    norm_eps,
    NUM_HEADS: tl.constexpr,
    NUM_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    KV_FP8: tl.constexpr,
    HEAD_NORM: tl.constexpr,
    PDL: tl.constexpr = False,  # kvik.triton_kernels.pdl
):
    wait_for_prior_kernel(PDL)
    # kv_cache [2, num_blocks, block_size, Hk, D]: a slot's [Hk, D] rows are contiguous, and the
    # values sit half_cache elements after the keys. A negative slot (padding) writes nothing.
    # KV_FP8: an e4m3 cache, keys and values quantized with the scales behind k/v_scale_ptr.
    # HEAD_NORM: query and key heads RMS-normalised (q/k_norm_ptr's weights) before the rotation.
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, cos_sin_ptr, cos_sin_stride, token, HALF, HALF_PAD)
    _rotate_heads(
        q_ptr + token * q_stride, q_out_ptr + token * NUM_HEADS * HEAD_SIZE, cos, sin,
        NUM_HEADS, NUM_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, TAIL_PAD, IS_NEOX,
        norm_w_ptr=q_norm_ptr, norm_eps=norm_eps, HEAD_NORM=HEAD_NORM, HEAD_PAD=HEAD_PAD,
    )  # fmt: skip
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        dst = kv_cache_ptr + slot * (NUM_KV_HEADS * HEAD_SIZE)
        if KV_FP8:
            _rotate_heads(
                k_ptr + token * k_stride, dst, cos, sin,
                NUM_KV_HEADS, NUM_KV_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, TAIL_PAD, IS_NEOX,
                tl.load(k_scale_ptr), True,
                norm_w_ptr=k_norm_ptr, norm_eps=norm_eps, HEAD_NORM=HEAD_NORM, HEAD_PAD=HEAD_PAD,
            )  # fmt: skip
        else:
            _rotate_heads(
                k_ptr + token * k_stride, dst, cos, sin,
                NUM_KV_HEADS, NUM_KV_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, TAIL_PAD, IS_NEOX,
                norm_w_ptr=k_norm_ptr, norm_eps=norm_eps, HEAD_NORM=HEAD_NORM, HEAD_PAD=HEAD_PAD,
            )  # fmt: skip
        h = tl.arange(0, NUM_KV_HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
        v = tl.load(v_ptr + token * v_stride + h * HEAD_SIZE + d, mask=mask)
        if KV_FP8:
            v = quantize_e4m3(v.to(tl.float32), tl.load(v_scale_ptr))
        ty = kv_cache_ptr.dtype.element_ty
        tl.store(dst + half_cache + h * HEAD_SIZE + d, v.to(ty), mask=mask)


# Cached: triton.next_power_of_2 is a constexpr function whose every call costs microseconds of
# host time, and a PIECEWISE step calls the rotary launch from Python once a layer.
@functools.cache
def rotary_constexprs(num_heads: int, num_kv_heads: int, head_size: int, rot_dim: int) -> dict:
    half = rot_dim // 2
    tail = head_size - rot_dim
    return {
        "NUM_HEADS": num_heads,
        "NUM_HEADS_PAD": triton.next_power_of_2(num_heads),
        "NUM_KV_HEADS": num_kv_heads,
        "NUM_KV_HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HEAD_SIZE": head_size,
        "HALF": half,
        "HALF_PAD": triton.next_power_of_2(half),
        "TAIL_PAD": triton.next_power_of_2(tail) if tail else 0,
    }


ROTARY_WARPS = 4


# Launched once a layer from Python in every step that is not one captured graph.
_launch_rotary_and_cache = FastLauncher(rotary_and_cache_kernel)


def _power_of_2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox: bool,
) -> tuple[Tensor, Tensor]:
    """query [T, H*D], key [T, Hk*D] (rows may be strided, e.g. views of a fused QKV output)."""
    t = query.shape[0]
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if t == 0:
        return q_out, k_out
    constexprs = rotary_constexprs(
        query.shape[1] // head_size, key.shape[1] // head_size, head_size, cos_sin_cache.shape[-1]
    )
    rotary_kernel[(t,)](
        positions, query, key, q_out, k_out, cos_sin_cache, query.stride(0), key.stride(0),
        cos_sin_cache.stride(0), **constexprs, IS_NEOX=is_neox, num_warps=ROTARY_WARPS,
    )  # fmt: skip
    return q_out, k_out


def rotary_and_cache(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox: bool,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    head_norms: HeadNorms | None = None,
) -> Tensor:
    """Rotates query [T, H*D] into a new tensor (returned) and key [T, Hk*D] into the paged
    ``kv_cache`` [2, num_blocks, block_size, Hk, D] at ``slot_mapping`` [T], value beside it. Rows
    of query, key and value may be strided (views of a fused QKV output). An FP8 cache needs
    ``k_scale`` and ``v_scale`` (fp32 scalars). ``head_norms``: each query and key head
    RMS-normalised first (``kvik.ops.rms_norm`` over the head with those weights)."""
    t = query.shape[0]
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert kv_cache.is_contiguous() and cos_sin_cache.stride(-1) == 1
    fp8, k_scale, v_scale = kv_scale_pointers(kv_cache, k_scale, v_scale)
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if t == 0:
        return q_out
    constexprs = rotary_constexprs(
        query.shape[1] // head_size, key.shape[1] // head_size, head_size, cos_sin_cache.shape[-1]
    )
    if head_norms is not None:
        q_norm, k_norm, eps = head_norms
        if q_norm.shape != (head_size,) or k_norm.shape != (head_size,):
            raise ValueError(
                f"head norm weights {tuple(q_norm.shape)} and {tuple(k_norm.shape)} must be "
                f"[{head_size}], one weight a head dimension"
            )
    else:
        q_norm = k_norm = q_out  # not read
        eps = 0.0
    pdl = uses_pdl(query.device)
    _launch_rotary_and_cache(
        (t,),
        (
            positions, query, key, value, q_out, kv_cache, slot_mapping, cos_sin_cache, k_scale,
            v_scale, q_norm, k_norm, query.stride(0), key.stride(0), value.stride(0),
            cos_sin_cache.stride(0), kv_cache.numel() // 2, eps,
        ),
        {
            **constexprs, "HEAD_PAD": _power_of_2_at_least(head_size), "IS_NEOX": is_neox,
            "KV_FP8": fp8, "HEAD_NORM": head_norms is not None, "PDL": pdl,
        },
        num_warps=ROTARY_WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return q_out
