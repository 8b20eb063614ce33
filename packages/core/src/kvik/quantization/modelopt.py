"""``modelopt``: NVIDIA ModelOpt FP8 checkpoints.

The method is named in config.json's ``quantization_config`` (``"quant_method": "modelopt",
"quant_algo": "FP8"``, the layers left unquantized in ``ignore`` or ``exclude_modules``), or, in
the older layout, in ``hf_quant_config.json`` (``{"quantization": {"quant_algo": "FP8",
"exclude_modules": [...]}}``). Each quantized layer has ``weight`` (e4m3 [N, K]), a per-tensor
``weight_scale`` and a static per-tensor ``input_scale`` (each [] or [1]). Exclusions may use
``*`` wildcards (``model.layers.*.mlp.gate``).
"""

from __future__ import annotations

from typing import Any

from kvik.quantization.base import LinearMethod, QuantizationConfig


class ModelOptConfig(QuantizationConfig):
    name = "modelopt"

    def __init__(self, ignored: list[str]) -> None:
        super().__init__()
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelOptConfig:
        section = config.get("quantization", config)  # hf_quant_config.json nests it
        algo = section.get("quant_algo")
        if algo is None or str(algo).upper() != "FP8":
            raise ValueError(
                f"modelopt: quant_algo {algo!r} is not supported; kvik reads ModelOpt's per-tensor "
                "FP8 ('FP8')"
            )
        ignored = list(section.get("exclude_modules") or []) + list(section.get("ignore") or [])
        return cls(ignored)

    def ignored_modules(self) -> list[str]:
        return self.ignored

    def quantized_method(self, layer, prefix: str, names: list[str]) -> LinearMethod:
        from kvik.quantization.fp8_methods import Fp8ScaledLinearMethod

        return Fp8ScaledLinearMethod("tensor", static_input=True)
