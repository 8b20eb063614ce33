"""Activations of gated MLPs."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvik import ops
from kvik.quantization.activation import FP8_PER_TOKEN_GROUP, QuantizedActivation


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._silu_and_mul = ops.small_op("silu_and_mul")
        #: Set after loading where the down projection takes its input quantized
        #: (kvik.quantization.activation): the forward then returns it so.
        self.quantize_output: str | None = None

    def forward(self, x: Tensor) -> Tensor | QuantizedActivation:
        # [T, 2*I] (gate, up) -> [T, I]
        if self.quantize_output == FP8_PER_TOKEN_GROUP:
            values, scales = torch.ops.kvik.silu_and_mul_fp8_group_quant(x)
            return QuantizedActivation(values, scales, x.dtype)
        return self._silu_and_mul(x)
