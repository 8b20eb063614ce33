"""The unquantized method: a dense weight in the model's dtype, ``F.linear`` unless the platform
has a faster kernel (the CPU's packed AMX/oneDNN weights, the CUDA one-row GEMV)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvik.quantization.base import LinearMethod
from kvik.quantization.kernels import UNQUANTIZED
from kvik.quantization.parameters import new_parameter, row_loader

if TYPE_CHECKING:
    from kvik.layers.linear import Linear


class UnquantizedLinearMethod(LinearMethod):
    scheme = UNQUANTIZED

    def create_weights(self, layer: Linear, params_dtype: torch.dtype) -> None:
        layer.weight = new_parameter(
            (layer.out_features, layer.in_features), params_dtype, row_loader(layer)
        )
