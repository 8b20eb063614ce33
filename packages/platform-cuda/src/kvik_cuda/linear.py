"""The CUDA platform's kernel of the unquantized scheme: kvik's one-row Triton GEMV for the layer
shapes where it beats cuBLAS.

A batch-1 decode step reads every weight once; cuBLAS covers the narrower layers with split-K
kernels and a reduction launch each, where the GEMV is one launch (kvik.triton_kernels.gemv). The
choice is per layer shape and architecture (kvik_cuda.tuning.gemv_config); every other batch size
stays on cuBLAS.
"""

from __future__ import annotations

from torch import Tensor, nn

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
