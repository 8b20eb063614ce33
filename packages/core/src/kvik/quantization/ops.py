"""The FP8 schemes' products as ``torch.library`` custom ops, so that ``torch.compile`` sees each
as one opaque node instead of tracing into a platform's kernel launches (Triton launchers, cuBLAS
scaled products); eagerly they dispatch on the tensors' device like the other ``torch.ops.kvik``
ops. Their default implementations are core's PyTorch references; a platform registers its own for
its device key when it is selected (``torch.library.register_kernel("kvik::fp8_block_linear",
"cuda", fn)``: kvik_cuda.registration).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kvik.quantization import fp8_reference


def _out(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("kvik::fp8_block_linear", mutates_args=())
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


@torch.library.custom_op("kvik::fp8_scaled_linear", mutates_args=())
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


@torch.library.custom_op("kvik::fused_moe_fp8_block", mutates_args=())
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
