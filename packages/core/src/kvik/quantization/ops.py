"""The FP8 schemes' products as ``torch.library`` custom ops, so that ``torch.compile`` sees each
as one opaque node instead of tracing into a platform's kernel launches (Triton launchers, cuBLAS
scaled products); eagerly they dispatch on the tensors' device like the other ``torch.ops.kvik``
ops. Their default implementations are core's PyTorch references; a platform registers its own for
its device key when it is selected (``torch.library.register_kernel("kvik::fp8_block_linear",
"cuda", fn)``: kvik_cuda.registration).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from kvik.op_library import custom_op
from kvik.quantization import fp8_reference


def _out(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@custom_op("kvik::fp8_block_linear", mutates_args=())
def fp8_block_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Optional[Tensor],  # noqa: UP045
) -> Tensor:
    """x [..., K] -> [..., N]: e4m3 weight [N, K] with block scales, activations per token group."""
    return fp8_reference.fp8_block_linear(x, weight, weight_scale, bias)


@fp8_block_linear.register_fake
def _(x, weight, weight_scale, bias):
    return _out(x, weight)


@custom_op("kvik::fp8_block_linear_quantized", mutates_args=())
def fp8_block_linear_quantized(
    values: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Optional[Tensor],  # noqa: UP045
    out_dtype: torch.dtype,
) -> Tensor:
    """``fp8_block_linear`` on activations its producer quantized (kvik.quantization.activation):
    e4m3 values [..., K], fp32 scales [..., ceil(K/128)] -> [..., N] in ``out_dtype``."""
    return fp8_reference.fp8_block_linear_quantized(
        values, scales, weight, weight_scale, bias, out_dtype
    )


@fp8_block_linear_quantized.register_fake
def _(values, scales, weight, weight_scale, bias, out_dtype):
    return values.new_empty(*values.shape[:-1], weight.shape[0], dtype=out_dtype)


# The producers' side (kvik.quantization.activation): each computes its result with the op
# without quantization (the kernel the device has registered for it, so that the values are
# those the projection would have quantized) and quantizes it per token group of 128. A platform
# registers one kernel that does both (kvik_cuda: the Triton RMSNorm and SiLU-and-mul).


def _unquantized_op(name: str):
    """``torch.ops.kvik.<name>``, imported here rather than with this module: ``kvik env`` reads
    the quantization registry without loading any kernel module (test_cli_env)."""
    import kvik.ops  # noqa: F401  (defines torch.ops.kvik.rms_norm and the others)

    return getattr(torch.ops.kvik, name)


# The producers' scales are tokens-contiguous, [T, groups] views of [groups, T] tensors
# (kvik.quantization.activation says why), here as on every platform: a compiled graph's fake
# tensors carry that layout too.


def _group_scales_layout(scales: Tensor) -> Tensor:
    """Row-major [T, groups] scales copied into the producers' layout."""
    return scales.t().contiguous().t()


def _group_quantized(y: Tensor) -> tuple[Tensor, Tensor]:
    q, scales = fp8_reference.quantize_per_token_group(y.reshape(-1, y.shape[-1]))
    return q.view(y.shape), _group_scales_layout(scales).view(*y.shape[:-1], scales.shape[-1])


def _group_quantized_fake(like: Tensor) -> tuple[Tensor, Tensor]:
    groups = -(-like.shape[-1] // fp8_reference.BLOCK)
    values = like.new_empty(like.shape, dtype=fp8_reference.FP8_DTYPE)
    scales = like.new_empty(groups, math.prod(like.shape[:-1]), dtype=torch.float32).t()
    return values, scales.view(*like.shape[:-1], groups)


@custom_op("kvik::rms_norm_fp8_group_quant", mutates_args=())
def rms_norm_fp8_group_quant(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``kvik::rms_norm`` quantized per token group: (e4m3 values, fp32 scales)."""
    return _group_quantized(_unquantized_op("rms_norm")(x, weight, eps))


@rms_norm_fp8_group_quant.register_fake
def _(x, weight, eps):
    return _group_quantized_fake(x)


@custom_op("kvik::fused_add_rms_norm_fp8_group_quant", mutates_args=())
def fused_add_rms_norm_fp8_group_quant(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``kvik::fused_add_rms_norm`` with the normed rows quantized per token group: (e4m3 values,
    fp32 scales, x + residual)."""
    normed, summed = _unquantized_op("fused_add_rms_norm")(x, residual, weight, eps)
    return (*_group_quantized(normed), summed)


@fused_add_rms_norm_fp8_group_quant.register_fake
def _(x, residual, weight, eps):
    return (*_group_quantized_fake(x), torch.empty_like(x))


@custom_op("kvik::silu_and_mul_fp8_group_quant", mutates_args=())
def silu_and_mul_fp8_group_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """``kvik::silu_and_mul`` quantized per token group: (e4m3 values, fp32 scales)."""
    return _group_quantized(_unquantized_op("silu_and_mul")(x))


@silu_and_mul_fp8_group_quant.register_fake
def _(x):
    return _group_quantized_fake(x.new_empty(*x.shape[:-1], x.shape[-1] // 2))


@custom_op("kvik::fp8_block_silu_and_mul_quantized", mutates_args=())
def fp8_block_silu_and_mul_quantized(
    values: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Optional[Tensor],  # noqa: UP045
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """A block-FP8 gate/up product on quantized input (``fp8_block_linear_quantized``, weight
    [2I, K]: gate's rows, then up's) followed by ``silu_and_mul_fp8_group_quant`` of its output in
    ``out_dtype``: down's input, (e4m3 values [..., I], fp32 scales [..., ceil(I/128)]). One op so
    that a platform can run it as one launch (kvik_cuda: at few rows)."""
    gate_up = fp8_reference.fp8_block_linear_quantized(
        values, scales, weight, weight_scale, bias, out_dtype
    )
    return _group_quantized(_unquantized_op("silu_and_mul")(gate_up))


@fp8_block_silu_and_mul_quantized.register_fake
def _(values, scales, weight, weight_scale, bias, out_dtype):
    like = values.new_empty(*values.shape[:-1], weight.shape[0] // 2, dtype=out_dtype)
    return _group_quantized_fake(like)


@custom_op("kvik::fp8_scaled_linear", mutates_args=())
def fp8_scaled_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Optional[Tensor],  # noqa: UP045
    bias: Optional[Tensor],  # noqa: UP045
) -> Tensor:
    """x [..., K] -> [..., N]: e4m3 weight [N, K], per-tensor or per-channel weight scales, static
    (``input_scale``) or dynamic per-token activation scales."""
    return fp8_reference.fp8_scaled_linear(x, weight, weight_scale, input_scale, bias)


@fp8_scaled_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias):
    return _out(x, weight)


@custom_op("kvik::fused_moe_fp8_block", mutates_args=())
def fused_moe_fp8_block(
    hidden: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    top_k: int,
    renormalize: bool,
) -> Tensor:
    """``kvik::fused_moe`` with block-FP8 experts (kvik.quantization.fp8_moe): e4m3 w13
    [E, 2I, H], w2 [E, H, I] with their 128 x 128 tile scales; activations per token group."""
    from kvik.quantization.fp8_moe import fused_moe_fp8_block as reference

    return reference(hidden, router_logits, w13, w13_scale, w2, w2_scale, top_k, renormalize)


@fused_moe_fp8_block.register_fake
def _(hidden, router_logits, w13, w13_scale, w2, w2_scale, top_k, renormalize):
    return torch.empty_like(hidden)
