"""``compressed-tensors``: FP8 checkpoints of llm-compressor (Neural Magic / Red Hat).

config.json's ``quantization_config``: ``"quant_method": "compressed-tensors"``, a ``format``
(``float-quantized`` or ``naive-quantized`` for FP8 weights stored as e4m3; a group may carry its
own), ``ignore`` (module names or ``re:`` regular expressions) and ``config_groups``, each with
``targets`` (``Linear``, module names or ``re:`` expressions), ``weights`` (``num_bits: 8, type:
float, strategy: tensor | channel``) and ``input_activations`` (``dynamic: false, strategy:
tensor``: a static ``input_scale``; ``dynamic: true, strategy: token``: per-token scales).
Each quantized layer has ``weight`` (e4m3 [N, K]), ``weight_scale`` ([1] per tensor, [N, 1] per
channel) and, when static, ``input_scale`` ([1]). A ``kv_cache_scheme`` is read by the KV cache,
not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvik.quantization.base import LinearMethod, QuantizationConfig, module_matches

FP8_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    """One config group's FP8 scheme."""

    weight_strategy: str  # "tensor" | "channel"
    static_input: bool  # a static per-tensor input_scale, else dynamic per-token


@dataclass(frozen=True)
class ConfigGroup:
    name: str
    targets: tuple[str, ...]
    scheme: Fp8Scheme

    def matches(self, module: str) -> bool:
        # "Linear" targets every linear layer (the seam asks only about linear layers).
        return any(t == "Linear" or module_matches(module, t) for t in self.targets)


def _parse_group(name: str, group: dict[str, Any], default_format: str | None) -> ConfigGroup:
    where = f"compressed-tensors group {name!r}"
    fmt = group.get("format") or default_format
    if fmt not in FP8_FORMATS:
        raise ValueError(
            f"{where}: format {fmt!r} is not supported; kvik reads FP8 ({', '.join(FP8_FORMATS)})"
        )
    weights = group.get("weights") or {}
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError(
            f"{where}: weights of {weights.get('num_bits')} bits, type {weights.get('type')!r} "
            "are not supported; kvik reads FP8 weights (num_bits 8, type 'float')"
        )
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("dynamic"):
        raise ValueError(
            f"{where}: FP8 weights with strategy {strategy!r} are not supported; kvik reads "
            "static 'tensor' and 'channel' weight scales"
        )
    if weights.get("symmetric") is False:
        raise ValueError(f"{where}: asymmetric FP8 weights (a zero point) are not supported")
    acts = group.get("input_activations")
    if acts is None:
        raise ValueError(
            f"{where}: weight-only FP8 (no input_activations) is not supported; kvik runs FP8 "
            "weights with FP8 activations"
        )
    if acts.get("num_bits") != 8 or acts.get("type") != "float":
        raise ValueError(f"{where}: input activations must be FP8 (num_bits 8, type 'float')")
    dynamic, act_strategy = bool(acts.get("dynamic")), acts.get("strategy")
    if (dynamic, act_strategy) == (False, "tensor"):
        static = True
    elif (dynamic, act_strategy) == (True, "token"):
        static = False
    else:
        raise ValueError(
            f"{where}: input activations with dynamic={dynamic} and strategy {act_strategy!r} "
            "are not supported; kvik runs static 'tensor' and dynamic 'token' activation scales"
        )
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise ValueError(f"{where} has no targets")
    return ConfigGroup(name, targets, Fp8Scheme(strategy, static))


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[ConfigGroup], ignored: list[str]) -> None:
        super().__init__()
        self.groups = groups
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups_config = config.get("config_groups") or {}
        if not groups_config:
            raise ValueError("compressed-tensors: the quantization_config has no config_groups")
        groups = [
            _parse_group(name, group, config.get("format")) for name, group in groups_config.items()
        ]
        return cls(groups, list(config.get("ignore") or []))

    def ignored_modules(self) -> list[str]:
        return self.ignored

    def scheme_of(self, module: str) -> Fp8Scheme | None:
        """The scheme of the first group that targets ``module``, or None (left unquantized)."""
        return next((g.scheme for g in self.groups if g.matches(module)), None)

    def is_ignored(self, name: str) -> bool:
        return super().is_ignored(name) or self.scheme_of(name) is None

    def quantized_method(self, layer, prefix: str, names: list[str]) -> LinearMethod:
        from kvik.quantization.fp8_methods import Fp8ScaledLinearMethod

        schemes = {self.scheme_of(name) for name in names}
        if len(schemes) != 1:
            raise ValueError(
                f"compressed-tensors: the shards of the fused layer {prefix} ({', '.join(names)}) "
                "are quantized with different schemes; kvik computes a fused layer in one scheme"
            )
        (scheme,) = schemes
        return Fp8ScaledLinearMethod(scheme.weight_strategy, scheme.static_input)
