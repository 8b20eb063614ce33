"""Choosing the attention backend: the platform's preference order, filtered by what each supports."""

from __future__ import annotations

import torch

from kvik.attention.backend import AttentionBackend
from kvik.platforms.base import Platform
from kvik.plugins.manager import get_plugin_manager


def select_attention_backend(
    platform: type[Platform], dtype: torch.dtype, head_size: int, block_size: int
) -> type[AttentionBackend]:
    registry = get_plugin_manager().attention_backends
    reasons = []
    for name in platform.attention_backends:
        if name not in registry:
            reasons.append(f"{name}: not registered")
            continue
        backend = registry.resolve(name)
        reason = backend.unsupported_reason(dtype, head_size, block_size)
        if reason is None:
            return backend
        reasons.append(f"{name}: {reason}")
    raise ValueError(
        f"no attention backend of platform {platform.name!r} supports dtype {dtype}, head size "
        f"{head_size}, block size {block_size} ({'; '.join(reasons) or 'it lists none'})"
    )
