"""Matrix products with weights reordered once for oneDNN, the CPU's bf16 GEMM library.

``F.linear`` on a bf16 CPU tensor already calls oneDNN, but reorders the weight into oneDNN's
blocked layout on every call; reordering once at load time makes batch-1 decoding's matrix-vector
products about 1.5x faster on this project's CPU machine (docs/benchmarks.md). The results are the
same bits: the same oneDNN kernel runs on the same layout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvik.layers.embedding import LMHead
from kvik.layers.linear import Linear

#: The batch size oneDNN chooses its weight layout for. Layouts for 1, 32 and 512 rows differ by
#: under 5% at batch 1 and 32; 32 is the middle of a decode batch's range.
BATCH_SIZE_HINT = 32


def packed_linear_supported(dtype: torch.dtype) -> bool:
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear:
    """y = x W^T + b, W held in oneDNN's layout (an opaque ``mkldnn`` tensor)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_SIZE_HINT)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:  # oneDNN refuses empty inputs
            return x.new_empty(0, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Give each ``Linear`` and the LM head a ``PackedLinear`` kernel.

    A packed ``Linear``'s dense weight is released (only the packed copy is read). The LM head keeps
    its dense weight, which a tied embedding also looks tokens up in. Returns how many were packed.
    """
    packed = 0
    for module in model.modules():
        if isinstance(module, (LMHead, Linear)):
            module.kernel = PackedLinear(module.weight, getattr(module, "bias", None))
            if isinstance(module, Linear):
                module.weight.data = module.weight.data.new_empty(0)
            packed += 1
    return packed
