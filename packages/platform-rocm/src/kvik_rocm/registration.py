"""Registering kvik's shared Triton kernels as the ROCm implementations of ``torch.ops.kvik.*``,
with this platform's launch configurations for AMD architectures.

ROCm builds of torch dispatch AMD GPUs under the "cuda" key, so the kernels are registered for it,
when the ROCm platform is selected and never on import.
"""

from __future__ import annotations

import functools

import torch

import kvik.ops  # noqa: F401  (defines torch.ops.kvik.*)
from kvik.triton_kernels.activation import silu_and_mul
from kvik.triton_kernels.argmax import argmax_rows
from kvik.triton_kernels.attention import register_attention_configs
from kvik.triton_kernels.eagle3_indices import eagle3_indices
from kvik.triton_kernels.fused_moe import fused_moe, register_moe_configs
from kvik.triton_kernels.kv_cache import reshape_and_cache
from kvik.triton_kernels.rms_norm import embed_rms_norm_cat, fused_add_rms_norm, rms_norm
from kvik.triton_kernels.rotary import rotary_embedding
from kvik_rocm.moe_tuning import fused_moe_config
from kvik_rocm.tuning import attention_config

KERNELS = {
    "kvik::rms_norm": rms_norm,
    "kvik::fused_add_rms_norm": fused_add_rms_norm,
    "kvik::rotary_embedding": rotary_embedding,
    "kvik::silu_and_mul": silu_and_mul,
    "kvik::reshape_and_cache": reshape_and_cache,
    "kvik::argmax_rows": argmax_rows,
    "kvik::embed_rms_norm_cat": embed_rms_norm_cat,
    "kvik::eagle3_indices": eagle3_indices,
    # bf16/fp16/fp32 experts; kvik::fused_moe_fp8_block stays unregistered (no e4m3fnuz yet).
    "kvik::fused_moe": fused_moe,
}


@functools.cache
def register_kernels() -> None:
    """Idempotent: torch keeps one registration per (op, device) and this runs once per process."""
    for op, kernel in KERNELS.items():
        torch.library.register_kernel(op, "cuda", kernel)
    register_attention_configs("gfx", attention_config)
    register_moe_configs("gfx", fused_moe_config)
