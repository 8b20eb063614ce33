"""The CUDA platform's kernels of the unquantized scheme: kvik's one-row Triton GEMV for the layer
shapes where it beats cuBLAS, and the LM head's product written as fp32 logits.

A batch-1 decode step reads every weight once; cuBLAS covers the narrower layers with split-K
kernels and a reduction launch each, where the GEMV is one launch (kvik.triton_kernels.gemv). The
choice is per layer shape and architecture (kvik_cuda.tuning.gemv_config); every other batch size
stays on cuBLAS.

The sampler takes fp32 logits. A bf16 LM head rounds cuBLAS's fp32 sums to bf16 and a copy widens
them again: one more launch a step that reads and writes the [rows, vocab] logits (96 µs of a
9.6 ms step at 256 rows on the H200, Llama-3.1-8B's 128,256 tokens; docs/benchmarks.md), and
logits closer than bf16's step (0.125 between 16 and 32) tie. ``Fp32LogitsKernel`` has cuBLAS
write the sums as they are (torch.mm's ``out_dtype``), as the CPU's AVX512-BF16 LM head does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvik.layers.embedding import LMHead
from kvik.layers.linear import Linear
from kvik.quantization.kernels import UNQUANTIZED, LinearKernel
from kvik.triton_kernels.gemv import GemvConfig, OneRowLinear
from kvik_cuda.tuning import gemv_config


class OneRowGemvKernel(LinearKernel):
    """One-row inputs on the GEMV, every other shape on ``F.linear`` (``OneRowLinear``), reading
    the layer's dense weight in place."""

    scheme = UNQUANTIZED

    def __init__(self, config: GemvConfig) -> None:
        self.config = config
        self.product: OneRowLinear | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.product = OneRowLinear(layer.weight, layer.bias, self.config)

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        return self.product(x)

    def __repr__(self) -> str:
        return f"OneRowGemvKernel({self.config})"


def one_row_gemv_kernel(layer: nn.Module, arch: str) -> OneRowGemvKernel | None:
    """The GEMV kernel for a ``Linear`` whose shape the tuning accepts on ``arch``
    (``kvik.triton_kernels.attention.device_arch``'s name), else None (cuBLAS). The LM head is
    not a ``Linear`` and stays on cuBLAS."""
    if not isinstance(layer, Linear):
        return None
    config = gemv_config(arch, layer.out_features, layer.in_features)
    return None if config is None else OneRowGemvKernel(config)


class Fp32LogitsKernel(LinearKernel):
    """The LM head on cuBLAS with fp32 output: bf16 or fp16 weights and hidden states, the
    logits the GEMM's fp32 accumulators (module doc)."""

    scheme = UNQUANTIZED

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        logits = torch.mm(rows, layer.weight.t(), out_dtype=torch.float32)
        return logits.view(*x.shape[:-1], logits.shape[-1])

    def apply_into(self, layer: nn.Module, x: Tensor, out: Tensor) -> Tensor:
        # cuBLAS writes the fp32 sums into the buffer itself (``aten::mm.dtype_out``): the FULL
        # graphs' logits land in the runner's shared buffer without a copy of [rows, vocab]
        # floats (at batch 256 over 128,256 tokens, 131 MB written twice: 84 µs a step on the
        # H100, docs/benchmarks.md).
        if out.dtype != torch.float32 or not out.is_contiguous():
            return super().apply_into(layer, x, out)
        rows = x.reshape(-1, x.shape[-1])
        torch.mm(rows, layer.weight.t(), out_dtype=torch.float32, out=out.view(-1, out.shape[-1]))
        return out

    def __repr__(self) -> str:
        return "Fp32LogitsKernel()"


def fp32_logits_kernel(layer: nn.Module) -> Fp32LogitsKernel | None:
    """The fp32-output kernel for an LM head of bf16 or fp16 weights, where torch's cuBLAS
    products take an output dtype (``aten::mm.dtype``, torch 2.8 and later); else None (the
    bf16 product, widened by the runner)."""
    if not isinstance(layer, LMHead) or layer.weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    return Fp32LogitsKernel() if hasattr(torch.ops.aten.mm, "dtype") else None
