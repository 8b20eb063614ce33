"""The FP8 KV cache's numerics, as every backend computes them (the PyTorch references).

A cache of ``torch.float8_e4m3fn`` holds each layer's keys divided by its ``k_scale`` and values
divided by its ``v_scale`` (fp32 scalars from the checkpoint, else 1.0), clamped to e4m3's finite
range and rounded to the nearest e4m3 value (ties to even). Reading multiplies back. The Triton
kernels (kvik.triton_kernels.kv_cache) and the CPU kernel (kvik_cpu's csrc/paged_attention.cpp)
compute the same bits on the way in.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_E4M3 = torch.float8_e4m3fn
#: The largest finite e4m3 value.
FP8_E4M3_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_E4M3


def quantize_kv(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` into e4m3: ``clamp(x / scale, ±448)``, computed in fp32, rounded to nearest even."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def dequantize_kv(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """e4m3 values back into ``dtype``: ``q * scale`` in fp32, then rounded to ``dtype``."""
    return (q.float() * scale).to(dtype)


def to_cache(x: Tensor, cache_dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """Keys or values as the cache stores them: quantized with ``scale`` into an FP8 cache, else
    cast to the cache's dtype."""
    if is_fp8(cache_dtype):
        if scale is None:
            raise ValueError("an fp8 KV cache needs the layer's k_scale and v_scale")
        return quantize_kv(x, scale)
    return x.to(cache_dtype)


def from_cache(x: Tensor, dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """Keys or values read from the cache, in ``dtype``: dequantized with ``scale`` from FP8."""
    if is_fp8(x.dtype):
        if scale is None:
            raise ValueError("an fp8 KV cache needs the layer's k_scale and v_scale")
        return dequantize_kv(x, scale, dtype)
    return x.to(dtype)


def write_slots(cache: Tensor, slots: Tensor, x: Tensor, scale: Tensor | None) -> None:
    """``cache[slots] = x`` as the cache stores it (``to_cache``); ``cache`` is [num_slots, ...]
    (one half of a layer's cache, flattened over blocks), ``slots`` int64 and all valid."""
    x = to_cache(x, cache.dtype, scale)
    if is_fp8(cache.dtype):  # PyTorch has no index_copy_ for float8 tensors: copy their bytes
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.index_copy_(0, slots, x)
