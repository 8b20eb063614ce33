"""Registering kvik's shared Triton kernels as the CUDA implementations of ``torch.ops.kvik.*``,
with this platform's launch configurations for NVIDIA architectures.

Called when the CUDA platform is selected, never on import: ROCm builds of torch use the same key.
"""

from __future__ import annotations

import functools
import os

import torch

import kvik.ops  # noqa: F401  (defines torch.ops.kvik.*)
import kvik.quantization.ops  # noqa: F401  (defines torch.ops.kvik.fp8_*_linear)
from kvik.triton_kernels.activation import silu_and_mul, silu_and_mul_fp8_group_quant
from kvik.triton_kernels.argmax import argmax_rows
from kvik.triton_kernels.attention import register_attention_configs, register_decode_plans
from kvik.triton_kernels.eagle3_indices import eagle3_indices
from kvik.triton_kernels.fused_moe import fused_moe, fused_moe_fp8_block, register_moe_configs
from kvik.triton_kernels.kv_cache import reshape_and_cache
from kvik.triton_kernels.rms_norm import (
    embed_rms_norm_cat,
    fused_add_rms_norm,
    fused_add_rms_norm_fp8_group_quant,
    rms_norm,
    rms_norm_fp8_group_quant,
)
from kvik.triton_kernels.rotary import rotary_embedding
from kvik_cuda import fp8
from kvik_cuda.moe_tuning import fused_moe_config
from kvik_cuda.tuning import attention_config, decode_plan

KERNELS = {
    "kvik::rms_norm": rms_norm,
    "kvik::fused_add_rms_norm": fused_add_rms_norm,
    "kvik::rotary_embedding": rotary_embedding,
    "kvik::silu_and_mul": silu_and_mul,
    "kvik::reshape_and_cache": reshape_and_cache,
    "kvik::argmax_rows": argmax_rows,
    "kvik::embed_rms_norm_cat": embed_rms_norm_cat,
    "kvik::eagle3_indices": eagle3_indices,
    "kvik::fused_moe": fused_moe,
    # Through custom ops so that torch.compile does not trace into the Triton launchers.
    "kvik::fp8_block_linear": fp8.fp8_block_linear,
    "kvik::fp8_block_linear_quantized": fp8.fp8_block_linear_quantized,
    "kvik::fp8_block_silu_and_mul_quantized": fp8.fp8_block_silu_and_mul_quantized,
    # The producers of a block-FP8 projection's quantized input (kvik.quantization.activation).
    "kvik::rms_norm_fp8_group_quant": rms_norm_fp8_group_quant,
    "kvik::fused_add_rms_norm_fp8_group_quant": fused_add_rms_norm_fp8_group_quant,
    "kvik::silu_and_mul_fp8_group_quant": silu_and_mul_fp8_group_quant,
    "kvik::fp8_scaled_linear": fp8.fp8_scaled_linear,
    "kvik::fused_moe_fp8_block": fused_moe_fp8_block,
}


@functools.cache
def register_kernels() -> None:
    """Idempotent: torch keeps one registration per (op, device) and this runs once per process."""
    for op, kernel in KERNELS.items():
        torch.library.register_kernel(op, "cuda", kernel)
    register_attention_configs("sm", attention_config)
    # KVIK_DECODE_PLANS=0 leaves decode launches to the defaults (A/B measurements).
    if os.environ.get("KVIK_DECODE_PLANS", "1") != "0":
        register_decode_plans("sm", decode_plan)
    register_moe_configs("sm", fused_moe_config)
