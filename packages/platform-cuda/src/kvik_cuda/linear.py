"""Which of a model's products run on kvik's one-row Triton GEMV instead of cuBLAS.

A batch-1 decode step reads every weight once; cuBLAS covers the narrower layers with split-K
kernels and a reduction launch each, where the GEMV is one launch (kvik.triton_kernels.gemv). The
choice is per layer shape and architecture (kvik_cuda.tuning.gemv_config); every other batch size
stays on cuBLAS.
"""

from __future__ import annotations

from torch import nn

from kvik.layers.linear import Linear
from kvik.triton_kernels.gemv import OneRowLinear
from kvik_cuda.tuning import gemv_config


def use_one_row_gemv(model: nn.Module, arch: str) -> int:
    """Give each ``Linear`` that has no kernel yet and whose shape the tuning accepts on ``arch``
    (``kvik.triton_kernels.attention.device_arch``'s name) a ``OneRowLinear`` kernel. Returns how
    many layers got one."""
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.kernel is not None:
            continue
        config = gemv_config(arch, *module.weight.shape)
        if config is not None:
            module.kernel = OneRowLinear(module.weight, module.bias, config)
            count += 1
    return count
