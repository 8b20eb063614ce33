"""RMSNorm, with the residual add fused in when a residual is passed."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvik import ops
from kvik.quantization.activation import FP8_PER_TOKEN_GROUP, QuantizedActivation


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self._rms_norm = ops.small_op("rms_norm")
        self._fused_add_rms_norm = ops.small_op("fused_add_rms_norm")
        #: Set after loading where the one linear layer reading this norm's output takes it
        #: quantized (kvik.quantization.activation): the forward then returns it so.
        self.quantize_output: str | None = None

    def forward(
        self, x: Tensor, residual: Tensor | None = None
    ) -> Tensor | QuantizedActivation | tuple[Tensor | QuantizedActivation, Tensor]:
        """norm(x), or with a residual (norm(x + residual), x + residual); norm(...) quantized
        per token group where ``quantize_output`` says so."""
        if self.quantize_output == FP8_PER_TOKEN_GROUP:
            # The dtype the norm's output has unfused (weight * normed): the model's, as a rule.
            dtype = x.dtype
            if self.weight.dtype != dtype:
                dtype = torch.promote_types(self.weight.dtype, dtype)
            if residual is None:
                values, scales = torch.ops.kvik.rms_norm_fp8_group_quant(x, self.weight, self.eps)
                return QuantizedActivation(values, scales, dtype)
            values, scales, summed = torch.ops.kvik.fused_add_rms_norm_fp8_group_quant(
                x, residual, self.weight, self.eps
            )
            return QuantizedActivation(values, scales, dtype), summed
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._fused_add_rms_norm(x, residual, self.weight, self.eps)
