"""Quantization: the seam between a model's linear layers and how their weights are stored and
multiplied (``base``), the formats kvik reads (``fp8``, ``compressed_tensors``, ``modelopt``), the
schemes' kernels (``kernels``, with the PyTorch references of ``fp8_reference``) and how a model's
method is chosen (``resolve``). See docs/architecture.md, "Quantization"."""

from kvik.quantization.base import LinearMethod, QuantizationConfig
from kvik.quantization.kernels import LinearKernel
from kvik.quantization.unquantized import UnquantizedLinearMethod

__all__ = ["LinearKernel", "LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod"]
