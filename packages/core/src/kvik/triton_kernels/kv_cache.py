"""The paged KV cache write: key/value [T, Hk, D] into kv_cache [2, num_blocks, block_size, Hk, D]
at slot_mapping [T] (block_id * block_size + offset; negative = padding, skipped). Reference:
``kvik.ops.reshape_and_cache``."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    key_stride,
    value_stride,
    head_stride_k,
    head_stride_v,
    half_cache,
    HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
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


def reshape_and_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """key/value [T, Hk, D] with the last dim contiguous; kv_cache contiguous."""
    t, heads, head_size = key.shape
    assert kv_cache.is_contiguous() and key.stride(-1) == 1 and value.stride(-1) == 1
    if t == 0:
        return
    constexprs, num_warps = reshape_and_cache_config(heads, head_size)
    reshape_and_cache_kernel[(t,)](
        key, value, kv_cache, slot_mapping, key.stride(0), value.stride(0), key.stride(1),
        value.stride(1), kv_cache[0].numel(), **constexprs, num_warps=num_warps,
    )  # fmt: skip
