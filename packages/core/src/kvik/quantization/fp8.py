"""``fp8``: FP8 checkpoints whose ``quantization_config`` says ``"quant_method": "fp8"``, and
online FP8 (``--quantization fp8`` of an unquantized checkpoint).

Checkpoint layouts:

- Hugging Face fine-grained FP8 (DeepSeek-V3, Qwen3-FP8): ``"weight_block_size": [128, 128]``,
  ``"activation_scheme": "dynamic"``; each quantized layer has ``weight`` (e4m3 [N, K]) and
  ``weight_scale_inv`` (fp32 [ceil(N/128), ceil(K/128)], multiplied despite its name);
  ``modules_to_not_convert`` lists the layers left unquantized.
- Per-tensor FP8 (vLLM's and AutoFP8's ``fp8`` checkpoints, no ``weight_block_size``): ``weight``,
  ``weight_scale`` ([] or [1]) and, with ``"activation_scheme": "static"``, ``input_scale``;
  ``ignored_layers`` lists the layers left unquantized. The config does not say how dynamic
  activations are scaled; kvik scales them per token (vLLM's default is one scale per tensor, which
  rounds coarser).
"""

from __future__ import annotations

from typing import Any

from kvik.quantization.base import LinearMethod, QuantizationConfig
from kvik.quantization.fp8_reference import BLOCK


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(
        self,
        serialized: bool,
        block_size: tuple[int, int] | None = None,
        static_input: bool = False,
        ignored: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.serialized = serialized
        self.block_size = block_size
        self.static_input = static_input
        self.ignored = list(ignored or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"fp8: activation_scheme must be 'dynamic' or 'static', got {scheme!r}"
            )
        ignored = list(config.get("modules_to_not_convert") or []) + list(
            config.get("ignored_layers") or []
        )
        block = config.get("weight_block_size")
        if block is None:
            return cls(True, None, scheme == "static", ignored)
        if list(block) != [BLOCK, BLOCK]:
            raise ValueError(
                f"fp8: weight_block_size {list(block)} is not supported; kvik's block-scaled "
                f"kernels take [{BLOCK}, {BLOCK}]"
            )
        if scheme != "dynamic":
            raise ValueError(
                "fp8: block-scaled weights (weight_block_size) need activation_scheme 'dynamic' "
                f"(activations quantized per token in groups of {BLOCK}), got {scheme!r}"
            )
        return cls(True, (BLOCK, BLOCK), False, ignored)

    @classmethod
    def from_flag(cls) -> Fp8Config:
        return cls(serialized=False)

    def ignored_modules(self) -> list[str]:
        return self.ignored

    def quantized_method(self, layer, prefix: str, names: list[str]) -> LinearMethod:
        from kvik.quantization.fp8_methods import (
            Fp8BlockLinearMethod,
            Fp8ScaledLinearMethod,
            OnlineFp8LinearMethod,
        )

        if not self.serialized:
            return OnlineFp8LinearMethod()
        if self.block_size is not None:
            return Fp8BlockLinearMethod("weight_scale_inv")
        return Fp8ScaledLinearMethod("tensor", self.static_input)

    def quantized_moe_method(self, layer, prefix: str):
        from kvik.quantization.fp8_moe import Fp8BlockMoeMethod

        if self.block_size is None:
            what = "per-tensor FP8" if self.serialized else "online FP8 (--quantization fp8)"
            raise ValueError(
                f"fp8: {prefix}: {what} experts are not supported; kvik runs block-FP8 experts "
                f"(weight_block_size [{BLOCK}, {BLOCK}], a fine-grained FP8 checkpoint)"
            )
        return Fp8BlockMoeMethod()
