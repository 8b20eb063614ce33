"""The quantization seam: a method's config, and what it decides for each linear layer.

``QuantizationConfig`` is what a method registers (``kvik_register_quantization_methods``): built
from a checkpoint's ``quantization_config`` (``from_config``) or from ``--quantization NAME``
alone (``from_flag``: online quantization of an unquantized checkpoint), it gives each linear
layer its ``LinearMethod`` as the layer is built (``get_linear_method``), leaving the layers its
ignore list names unquantized.

A ``LinearMethod`` owns one layer's parameters:

- ``create_weights(layer, params_dtype)``: registers the parameters the checkpoint holds, each
  with a ``weight_loader`` that places fused q/k/v and gate/up shards (kvik.quantization.
  parameters);
- ``process_weights_after_loading(layer, platform)``: once the checkpoint is read, puts them in
  its scheme's layout (merges per-shard scales, renames, transposes) and asks the platform for the
  scheme's kernel (``Platform.linear_kernel``), which may repack them in turn;
- ``apply(layer, x)``: the product, every step.

Layers name themselves by their kvik module name (``model.layers.0.self_attn.qkv_proj``); ignore
lists use the checkpoint's names (``model.layers.0.self_attn.q_proj``), so a config knows the
model's packing (``packed_modules_mapping``: checkpoint module -> (kvik module, shard id)). A fused
layer is quantized only when all its shards are; some but not all is an error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from kvik.quantization.kernels import LinearKernel, reference_kernel

if TYPE_CHECKING:
    from kvik.layers.linear import Linear
    from kvik.layers.moe import FusedMoE
    from kvik.platforms.base import Platform
    from kvik.quantization.moe_methods import MoeMethod


class LinearMethod:
    """How one linear layer stores, loads and computes its product (module docstring)."""

    #: The scheme whose kernel runs the product (kvik.quantization.kernels.SCHEMES).
    scheme: ClassVar[str] = ""

    def __init__(self) -> None:
        #: The kernel ``apply`` calls: core's reference until the platform's is chosen after loading.
        self.kernel: LinearKernel = reference_kernel(self.scheme) if self.scheme else LinearKernel()

    def create_weights(self, layer: Linear, params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module, platform: type[Platform]) -> None:
        """By default: the platform's kernel of ``scheme``, given the tensors as loaded."""
        self.use_platform_kernel(layer, platform)

    def use_platform_kernel(self, layer: nn.Module, platform: type[Platform]) -> None:
        self.kernel = platform.linear_kernel(self.scheme, layer)
        self.kernel.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        return self.kernel.apply(layer, x)

    def apply_into(self, layer: nn.Module, x: Tensor, out: Tensor) -> Tensor:
        """``apply`` written into ``out`` (``LinearKernel.apply_into``)."""
        return self.kernel.apply_into(layer, x, out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kernel={self.kernel!r})"


class QuantizationConfig:
    """A quantization method: parsed from a checkpoint or a flag, it chooses each layer's
    ``LinearMethod``. Subclasses set ``name`` (the name it is registered under) and implement
    ``from_config`` and/or ``from_flag`` and ``quantized_method``."""

    name: ClassVar[str] = ""
    #: Platforms (by name) this method runs on besides those whose ``supported_quantization``
    #: lists it: a vendor's method declares where its kernels run.
    platforms: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        #: checkpoint module name -> (kvik module name, shard id), the model's
        #: ``packed_modules_mapping``; set by ``for_model``.
        self.packed_modules_mapping: dict[str, tuple[str, int | str]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """From a checkpoint's ``quantization_config`` (config.json), or ``hf_quant_config.json``."""
        raise ValueError(f"quantization method {cls.name!r} reads no checkpoint configuration")

    @classmethod
    def from_flag(cls) -> QuantizationConfig:
        """From ``--quantization NAME`` on a checkpoint without a ``quantization_config``."""
        raise ValueError(
            f"quantization method {cls.name!r} needs a checkpoint quantized with it; it cannot "
            "quantize an unquantized checkpoint as it loads"
        )

    def for_model(self, packed_modules_mapping: Mapping[str, tuple[str, int | str]]) -> None:
        self.packed_modules_mapping = dict(packed_modules_mapping)

    # -- per layer ---------------------------------------------------------------------------

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        """The method of the layer named ``prefix``: unquantized where the ignore list names it
        (all of its shards), else ``quantized_method``."""
        from kvik.quantization.unquantized import UnquantizedLinearMethod

        names = self.checkpoint_names(layer, prefix)
        skipped = [self.is_ignored(name) for name in names]
        if all(skipped):
            return UnquantizedLinearMethod()
        if any(skipped):
            kept = [n for n, s in zip(names, skipped, strict=True) if not s]
            raised = [n for n, s in zip(names, skipped, strict=True) if s]
            raise ValueError(
                f"{self.name}: the fused layer {prefix} has shards that are quantized "
                f"({', '.join(kept)}) and shards that are not ({', '.join(raised)}); kvik "
                "computes a fused layer in one scheme"
            )
        return self.quantized_method(layer, prefix, names)

    def quantized_method(self, layer: Linear, prefix: str, names: list[str]) -> LinearMethod:
        """The method of a layer that is quantized; ``names``: its checkpoint modules (one per
        shard of a fused layer)."""
        raise NotImplementedError

    def get_moe_method(self, layer: FusedMoE, prefix: str) -> MoeMethod:
        """The method of the mixture-of-experts layer named ``prefix`` (``model.layers.0.mlp.
        experts``): unquantized where the ignore list names every expert projection (by
        transformers' per-expert names, ``<prefix>.N.gate_proj``), else ``quantized_moe_method``.
        """
        from kvik.layers.moe import EXPERT_PROJECTIONS
        from kvik.quantization.moe_methods import UnquantizedMoeMethod

        names = [
            f"{prefix}.{e}.{proj}" for e in range(layer.num_experts) for proj in EXPERT_PROJECTIONS
        ]
        skipped = [self.is_ignored(name) for name in names]
        if all(skipped):
            return UnquantizedMoeMethod()
        if any(skipped):
            raise ValueError(
                f"{self.name}: the ignore list leaves some but not all expert projections of "
                f"{prefix} unquantized (e.g. {names[skipped.index(True)]}); kvik computes a "
                "layer's experts in one scheme"
            )
        return self.quantized_moe_method(layer, prefix)

    def quantized_moe_method(self, layer: FusedMoE, prefix: str) -> MoeMethod:
        """The method of a mixture-of-experts layer whose experts are quantized."""
        raise ValueError(
            f"quantization method {self.name!r} does not quantize mixture-of-experts layers "
            f"({prefix}); put the experts in its ignore list or use an unquantized checkpoint"
        )

    def ignored_modules(self) -> Iterable[str]:
        """The checkpoint's ignore list (names, ``re:`` regular expressions or ``*`` patterns)."""
        return ()

    def is_ignored(self, name: str) -> bool:
        return any(module_matches(name, pattern) for pattern in self.ignored_modules())

    def checkpoint_names(self, layer: Linear, prefix: str) -> list[str]:
        """The checkpoint modules a layer holds: itself, or each of its shards in shard order."""
        parent, _, leaf = prefix.rpartition(".")
        by_shard = {
            shard_id: module
            for module, (packed, shard_id) in self.packed_modules_mapping.items()
            if packed == leaf
        }
        if not layer.shards or not by_shard:
            return [prefix]
        if set(by_shard) != set(layer.shards):
            raise ValueError(
                f"the model's packed_modules_mapping gives {prefix} the shards "
                f"{sorted(map(str, by_shard))}, but the layer has {list(layer.shards)}"
            )
        return [f"{parent}.{by_shard[s]}" if parent else by_shard[s] for s in layer.shards]


def module_matches(name: str, pattern: str) -> bool:
    """Whether an ignore-list entry names the module ``name``: ``re:<regex>`` (compressed-tensors;
    matched from the start), a pattern with ``*`` (ModelOpt), or a module name: the module itself,
    one of its parents, or a name it ends with (``lm_head`` for ``model.lm_head``)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if "*" in pattern or "?" in pattern:
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)
