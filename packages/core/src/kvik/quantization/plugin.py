"""Entry point ``quantization`` of the ``kvik`` group: core's quantization methods, registered
through the same hook as a vendor plugin's."""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION

#: Core's methods: name -> config class (each a kvik.quantization.base.QuantizationConfig).
BUILTIN_METHODS = {
    "fp8": "kvik.quantization.fp8:Fp8Config",
    "compressed-tensors": "kvik.quantization.compressed_tensors:CompressedTensorsConfig",
    "modelopt": "kvik.quantization.modelopt:ModelOptConfig",
}


@kvik.hookimpl
def kvik_register_quantization_methods(register):
    for name, target in BUILTIN_METHODS.items():
        register(name, target)
