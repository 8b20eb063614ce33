"""Activations quantized by the layer that produces them, for the one linear layer that reads them.

A block-FP8 linear layer quantizes its input per token in groups of 128 before its product: on a
GPU that is a launch of its own in every layer's four products, a few microseconds each where a
batch-1 step's kernels take a few tens. The norm before q/k/v and before gate/up, and the SiLU-and-
mul before down, already read and write every element of those inputs, so they can write the
e4m3 values and their scales instead, and the product skips its quantization.

- A model declares which producer feeds which linear layer: a module's ``activation_links()``
  returns (producer, consumer) pairs (kvik_models' Llama decoder layer: its two norms and q/k/v and
  gate/up; its MLP: SiLU-and-mul and down; its attention: the attention layer and o_proj). A
  producer is an ``RMSNorm``, a ``SiluAndMul`` or an ``Attention``; the attention layer quantizes
  where its backend's launch can write the quantized output (``AttentionImpl.quantizes_output``:
  the Triton backend, heads of 128 or 256, or of 64 in even groups) and otherwise hands o_proj its output as it is.
- After loading, ``link_quantized_activations`` gives a producer its consumer's input
  quantization (``producer.quantize_output``) where the consumer's kernel takes quantized input
  (``LinearKernel.quantized_input``) and the platform fuses it
  (``Platform.fuses_activation_quantization``). The producer then returns a ``QuantizedActivation``
  and the consumer's kernel multiplies it as it is.
- Fused or not, the numbers are the same: the producer rounds its result to the activations'
  dtype and quantizes that, exactly what the consumer would have quantized (tests check the
  equality bit for bit on the CPU, and the Triton kernels against the PyTorch references).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

import kvik.quantization.ops  # noqa: F401  (defines the producers' torch.ops.kvik.*_fp8_group_quant)

if TYPE_CHECKING:
    from kvik.platforms.base import Platform

#: e4m3 values with one fp32 scale per token and 128 consecutive features (block FP8's activations).
FP8_PER_TOKEN_GROUP = "fp8_per_token_group"


class QuantizedActivation(NamedTuple):
    """Activations [..., K] as a producer quantized them for its consumer: e4m3 ``values``
    [..., K], fp32 ``scales`` [..., ceil(K / 128)], and the ``dtype`` they had (the product's
    output dtype). A NamedTuple, so that torch.compile traces it as a tuple of tensors.

    The scales are tokens-contiguous (a [T, groups] view of a [groups, T] tensor, as
    ``kvik.triton_kernels.fp8_quant.empty_group_scales`` makes them) on every platform: the
    layout cuBLAS's blockwise-scaled products read, so that a GPU's large products take them
    without a transposing copy; consumers read them through their strides."""

    values: Tensor
    scales: Tensor
    dtype: torch.dtype


def empty_group_quantized(like: Tensor) -> QuantizedActivation:
    """Uninitialised e4m3 values shaped as the activations ``like`` [T, K] and fp32 scales [T,
    ceil(K / 128)] in the producers' layout (tokens contiguous), for a producer that quantizes
    as it writes."""
    t, k = like.shape
    values = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=like.device)
    scales = torch.empty(-(-k // 128), t, dtype=torch.float32, device=like.device).t()
    return QuantizedActivation(values, scales, like.dtype)


def link_quantized_activations(model: nn.Module, platform: type[Platform]) -> int:
    """Let every producer that a module of ``model`` links to a linear layer write that layer's
    quantized input, where the layer's kernel takes it and ``platform`` fuses it; the others are
    left as they are (a producer already linked is unlinked first, so this can run again after
    the kernels change). Returns how many producers now quantize."""
    linked = 0
    for module in model.modules():
        links = getattr(module, "activation_links", None)
        if links is None:
            continue
        for producer, consumer in links():
            kind = consumer.quant_method.kernel.quantized_input
            fuse = kind is not None and platform.fuses_activation_quantization(kind)
            producer.quantize_output = kind if fuse else None
            linked += fuse
    return linked
