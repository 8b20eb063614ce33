"""Choosing the attention backend: the platform's preference order, filtered by what each supports."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from kvik.attention.backend import AttentionBackend, AttentionSpec
from kvik.platforms.base import Platform
from kvik.plugins.manager import get_plugin_manager

if TYPE_CHECKING:
    from kvik.layers.attention import Attention
    from kvik.worker.model_runner import ModelRunner


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


def attach_attention(
    runner: ModelRunner, layers: Iterable[Attention], kv_cache_dtype: torch.dtype | None = None
) -> tuple[type[AttentionBackend], Any]:
    """Give attention layers (the target's, or a proposer's own) the runner's platform backend
    for a KV cache of ``kv_cache_dtype`` (default: the model's dtype) in the runner's blocks: each
    layer's impl, with the layer's k/v scales, and one metadata builder for them all, sized by the
    runner's limits. Returns (backend, builder)."""
    layers = list(layers)
    first = layers[0]
    cache_dtype = runner.dtype if kv_cache_dtype is None else kv_cache_dtype
    backend = select_attention_backend(
        runner.platform, runner.dtype, first.head_size, runner.block_size, cache_dtype
    )
    for layer in layers:
        layer.impl = backend.impl_class()(
            layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads, layer.sliding_window
        )
        # Set after construction, so that an impl whose __init__ predates the scales still builds.
        layer.impl.k_scale, layer.impl.v_scale = layer.k_scale, layer.v_scale
    builder = backend.builder_class()(
        backend,
        AttentionSpec(
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=runner.dtype,
            block_size=runner.block_size,
            max_num_seqs=runner.max_num_seqs,
            max_num_tokens=runner.max_num_tokens,
            max_model_len=runner.max_model_len,
            device=runner.device,
            kv_cache_dtype=cache_dtype,
        ),
    )
    return backend, builder
