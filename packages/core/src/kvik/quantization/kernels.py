"""Linear kernels: how a platform computes one *scheme* of linear layer.

A linear method (kvik.quantization.base) decides a layer's parameters and, after loading, puts
them in its scheme's layout; the platform then gives the kernel that computes the product
(``Platform.linear_kernel(scheme, layer)``). The schemes and the tensors their kernels read from
the layer after processing:

============  =========================================================================
scheme        layer tensors (as ``process_weights_after_loading`` leaves them)
============  =========================================================================
unquantized   ``weight`` [N, K] in the activations' dtype, ``bias`` [N] or None
fp8_block     ``weight`` e4m3 [N, K], ``weight_scale`` fp32 [ceil(N/128), ceil(K/128)], ``bias``
fp8_scaled    ``weight`` e4m3 [N, K], ``weight_scale`` fp32 [1] or [N], ``input_scale`` fp32 [1]
              or None (dynamic per-token activations), ``bias``
============  =========================================================================

Core's FP8 kernels call the custom ops ``torch.ops.kvik.fp8_block_linear`` and
``fp8_scaled_linear`` (kvik.quantization.ops), opaque to ``torch.compile``, whose default
implementations run each scheme in PyTorch (kvik.quantization.fp8_reference): the CPU's FP8 path
and the oracle of faster kernels. A platform registers its own function of the scheme's signature
(``fp8_block_linear(x, weight, weight_scale, bias)``, ``fp8_scaled_linear(x, weight,
weight_scale, input_scale, bias)``, and the fused ``fp8_block_silu_and_mul_quantized``) for its device key (kvik_cuda does), or wraps it in the same
class: ``Fp8BlockKernel(my_fp8_block_linear)``. A kernel that repacks the weights (the CPU's AMX
layout) overrides ``process_weights_after_loading``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kvik.quantization.ops  # noqa: F401  (defines torch.ops.kvik.fp8_*_linear)
from kvik.quantization.activation import FP8_PER_TOKEN_GROUP, QuantizedActivation

UNQUANTIZED = "unquantized"
FP8_BLOCK = "fp8_block"
FP8_SCALED = "fp8_scaled"
SCHEMES = (UNQUANTIZED, FP8_BLOCK, FP8_SCALED)


class LinearKernel:
    """One layer's product on one platform. ``process_weights_after_loading`` runs once, after
    the method has put the layer's tensors in the scheme's layout; ``apply`` runs every step."""

    scheme: str = ""
    #: The quantized input ``apply`` also takes, as a ``QuantizedActivation`` its producer wrote
    #: (kvik.quantization.activation: FP8_PER_TOKEN_GROUP), or None: activations only.
    quantized_input: str | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Adapt the layer's tensors to this kernel (repack them); by default read as they are."""

    def apply_silu_and_mul(
        self, layer: nn.Module, x: QuantizedActivation
    ) -> QuantizedActivation | None:
        """For a gate/up layer (weight rows: gate's, then up's) whose input and whose consumer's
        input are both quantized (kvik.quantization.activation): the product, SiLU-and-mul and
        the down projection's quantization in one op, or None where this kernel has no such op
        (the caller then runs the three itself)."""
        return None

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        raise NotImplementedError

    def apply_into(self, layer: nn.Module, x: Tensor, out: Tensor) -> Tensor:
        """``apply``'s product written into ``out`` (its shape; its dtype may be wider) and
        returned. By default computed, then copied; a kernel whose product can write there
        directly saves the copy (the CUDA graph runner's logits: kvik_cuda.linear)."""
        return out.copy_(self.apply(layer, x))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchLinearKernel(LinearKernel):
    """unquantized: ``F.linear``."""

    scheme = UNQUANTIZED

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        return F.linear(x, layer.weight, getattr(layer, "bias", None))


class _FunctionKernel(LinearKernel):
    """A scheme computed by one function of the scheme's signature."""

    def __init__(self, function: Callable[..., Tensor]) -> None:
        self.function = function

    def __repr__(self) -> str:
        name = getattr(self.function, "__module__", "?") + "." + self.function.__qualname__
        return f"{type(self).__name__}({name})"


class Fp8BlockKernel(_FunctionKernel):
    """fp8_block: ``function(x, weight, weight_scale, bias)``; activations its producer quantized
    per token group go to ``quantized_function(values, scales, weight, weight_scale, bias,
    out_dtype)`` (by default ``torch.ops.kvik.fp8_block_linear_quantized``)."""

    scheme = FP8_BLOCK
    quantized_input = FP8_PER_TOKEN_GROUP

    def __init__(
        self,
        function: Callable[..., Tensor] | None = None,
        quantized_function: Callable[..., Tensor] | None = None,
        silu_and_mul_function: Callable[..., tuple[Tensor, Tensor]] | None = None,
    ) -> None:
        function = function or torch.ops.kvik.fp8_block_linear
        super().__init__(function)
        self.quantized_function = quantized_function or torch.ops.kvik.fp8_block_linear_quantized
        # The op by default only beside the default products: a platform that brings its own
        # product and not this would otherwise get core's PyTorch reference for gate/up.
        if silu_and_mul_function is None and quantized_function is None:
            silu_and_mul_function = torch.ops.kvik.fp8_block_silu_and_mul_quantized
        self.silu_and_mul_function = silu_and_mul_function

    def apply_silu_and_mul(
        self, layer: nn.Module, x: QuantizedActivation
    ) -> QuantizedActivation | None:
        """``silu_and_mul_function(values, scales, weight, weight_scale, bias, out_dtype)`` (by
        default ``torch.ops.kvik.fp8_block_silu_and_mul_quantized``, one launch on a GPU at few
        rows); None where the kernel was given a ``quantized_function`` and no such function."""
        if self.silu_and_mul_function is None:
            return None
        values, scales = self.silu_and_mul_function(
            x.values, x.scales, layer.weight, layer.weight_scale, getattr(layer, "bias", None),
            x.dtype,
        )  # fmt: skip
        return QuantizedActivation(values, scales, x.dtype)

    def apply(self, layer: nn.Module, x: Tensor | QuantizedActivation) -> Tensor:
        bias = getattr(layer, "bias", None)
        if isinstance(x, QuantizedActivation):
            return self.quantized_function(
                x.values, x.scales, layer.weight, layer.weight_scale, bias, x.dtype
            )
        return self.function(x, layer.weight, layer.weight_scale, bias)


class Fp8ScaledKernel(_FunctionKernel):
    """fp8_scaled: ``function(x, weight, weight_scale, input_scale, bias)``."""

    scheme = FP8_SCALED

    def __init__(self, function: Callable[..., Tensor] | None = None) -> None:
        function = function or torch.ops.kvik.fp8_scaled_linear
        super().__init__(function)

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        return self.function(
            x,
            layer.weight,
            layer.weight_scale,
            getattr(layer, "input_scale", None),
            getattr(layer, "bias", None),
        )


_REFERENCES: dict[str, Callable[[], LinearKernel]] = {
    UNQUANTIZED: TorchLinearKernel,
    FP8_BLOCK: Fp8BlockKernel,
    FP8_SCALED: Fp8ScaledKernel,
}


def reference_kernel(scheme: str, layer: Any = None) -> LinearKernel:
    """Core's PyTorch kernel of ``scheme`` (what ``Platform.linear_kernel`` returns by default)."""
    if scheme not in _REFERENCES:
        raise ValueError(f"unknown linear scheme {scheme!r}; kvik's schemes: {', '.join(SCHEMES)}")
    return _REFERENCES[scheme]()
