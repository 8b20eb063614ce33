"""Choosing the attention backend: the platform's preference order, filtered by what each supports."""

from __future__ import annotations

import torch

from kvik.attention.backend import AttentionBackend
from kvik.platforms.base import Platform
from kvik.plugins.manager import get_plugin_manager


def select_attention_backend(
    platform: type[Platform],
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    kv_cache_dtype: torch.dtype | None = None,
) -> type[AttentionBackend]:
    """The first backend of the platform's preference order that supports the model's dtype, head
    size, block size and KV cache dtype (None: the model's dtype)."""
    kv_cache_dtype = kv_cache_dtype or dtype
    registry = get_plugin_manager().attention_backends
    reasons = []
    for name in platform.attention_backends:
        if name not in registry:
            reasons.append(f"{name}: not registered")
            continue
        backend = registry.resolve(name)
        reason = backend.unsupported_reason(dtype, head_size, block_size)
        stored = (dtype, *backend.supported_kv_cache_dtypes)
        if reason is None and kv_cache_dtype not in stored:
            reason = f"KV cache dtype {kv_cache_dtype} not in {stored}"
        if reason is None:
            return backend
        reasons.append(f"{name}: {reason}")
    kv = f", KV cache dtype {kv_cache_dtype}" if kv_cache_dtype != dtype else ""
    raise ValueError(
        f"no attention backend of platform {platform.name!r} supports dtype {dtype}, head size "
        f"{head_size}, block size {block_size}{kv} ({'; '.join(reasons) or 'it lists none'})"
    )
