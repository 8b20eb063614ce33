"""Resolve a model folder into a ModelConfig, and build the model with its weights on a device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvik.config import LOAD_FORMATS, ModelConfig, parse_dtype, read_generation_config
from kvik.distributed.parallel_state import get_tp_group
from kvik.layers.linear import heads_per_rank
from kvik.model_loader.dummy import load_dummy_weights
from kvik.model_loader.generation_config import sampling_defaults
from kvik.model_loader.gguf_loader import (
    gguf_generation_config,
    gguf_hf_config,
    iter_gguf_weights,
)
from kvik.model_loader.hf_config_classes import without_generated_docstrings
from kvik.model_loader.kv_scales import take_kv_scales
from kvik.model_loader.resolve import resolve_model, resolve_tokenizer
from kvik.model_loader.safetensors_loader import (
    iterate_safetensors,
    iterate_safetensors_slices,
    safetensors_files,
)
from kvik.model_loader.weight_slice import CheckpointSlice
from kvik.models.registry import get_model_class
from kvik.platforms.base import Platform
from kvik.quantization.resolve import resolve_quantization


def load_model_config(
    model: str | None,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    load_format: str = "auto",
    platform_default_dtype: str | torch.dtype = "float32",
    seed: int = 0,
    tokenizer: str | None = None,
    generation_config: str = "auto",
    quantization: str | None = None,
) -> ModelConfig:
    """Resolve ``model`` (None: the default model) and read its config, checked against what was
    asked for. ``dtype="auto"`` means the platform's default; ``generation_config`` chooses where
    sampling defaults come from (kvik.model_loader.generation_config); ``quantization`` names a
    quantization method: the checkpoint's (checked), or one to apply as it loads."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    resolved = resolve_model(model)
    if tokenizer is not None:
        tokenizer = resolve_tokenizer(tokenizer)
    path = resolved.path
    if resolved.kind == "gguf":
        if load_format == "safetensors":
            raise ValueError(f"{path} is a GGUF file: load_format 'safetensors' cannot read it")
        with without_generated_docstrings():
            hf_config = gguf_hf_config(path)
        model_generation_config = gguf_generation_config(path)
    else:
        if load_format == "gguf":
            raise ValueError(f"{path} is a folder: load_format 'gguf' needs a .gguf file")
        from transformers import AutoConfig

        try:
            with without_generated_docstrings():
                hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers' validators raise several kinds
            reason = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: config.json is not a configuration transformers reads: "
                             f"{reason}") from e  # fmt: skip
        model_generation_config = read_generation_config(path)
    if load_format == "auto":
        load_format = "gguf" if resolved.kind == "gguf" else "safetensors"
    _check_sizes(hf_config, path if resolved.kind == "gguf" else path / "config.json")
    max_position = hf_config.max_position_embeddings
    if max_model_len is None:
        max_model_len = max_position
    elif not 0 < max_model_len <= max_position:
        raise ValueError(
            f"max_model_len {max_model_len} must be in 1..{max_position} "
            f"(the model's max_position_embeddings)"
        )
    model_class = get_model_class(_architecture(hf_config, path))
    method, quant_config = resolve_quantization(
        hf_config,
        path if resolved.kind != "gguf" else None,
        quantization,
        getattr(model_class, "packed_modules_mapping", {}),
    )
    config = ModelConfig(
        path=path,
        hf_config=hf_config,
        dtype=parse_dtype(platform_default_dtype if dtype == "auto" else dtype),
        max_model_len=max_model_len,
        load_format=load_format,
        tokenizer=tokenizer,
        seed=seed,
        generation_config=model_generation_config,
        sampling_defaults=sampling_defaults(generation_config, model_generation_config),
        name=resolved.display_name,
        quantization=method,
        quant_config=quant_config,
    )
    # Fail here, before an engine is built, on missing weights.
    if load_format == "safetensors":
        safetensors_files(path)
    return config


def _check_sizes(hf_config, source) -> None:
    """The sizes transformers takes as they come and the model would fail on far from the
    cause: a division by zero, a weight shape error, a scheduler's limit."""

    def at_least(key: str, value, least: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            what = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise ValueError(f"{source}: {key} must be {what}, got {value!r}")

    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else kv_heads
    at_least("num_attention_heads", heads)
    at_least("num_key_value_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads} (each KV head serves a whole group of query heads)"
        )
    at_least("max_position_embeddings", hf_config.max_position_embeddings)
    if (window := getattr(hf_config, "sliding_window", None)) is not None:
        at_least("sliding_window", window, 0)  # 0: none, in some configs


def _architecture(hf_config, path) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{path}/config.json names no architecture ('architectures')")
    return archs[0]


def check_tensor_parallel(model_config: ModelConfig, tp_size: int) -> None:
    """What the ranks would refuse while building the model, refused before they start (a user's
    error then reads as one message, not as every rank's traceback): a GGUF checkpoint, a mixture
    of experts, attention heads that do not split between the ranks."""
    if tp_size == 1:
        return
    if model_config.load_format == "gguf":
        raise ValueError(gguf_tensor_parallel_message(tp_size))
    hf = model_config.hf_config
    if getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None):
        raise ValueError(
            f"{model_config.architecture} (a mixture of experts) does not run under tensor "
            f"parallelism yet (asked for {tp_size} ranks); use --tensor-parallel-size 1"
        )
    heads = getattr(hf, "num_attention_heads", None)
    if heads:
        heads_per_rank(heads, getattr(hf, "num_key_value_heads", None) or heads, tp_size)


def gguf_tensor_parallel_message(tp_size: int) -> str:
    return (
        f"GGUF checkpoints do not load under tensor parallelism (asked for {tp_size} ranks): "
        "their quantized blocks are dequantized whole; use a safetensors checkpoint or "
        "--tensor-parallel-size 1"
    )


def iterate_weights(
    model_config: ModelConfig,
) -> Iterable[tuple[str, torch.Tensor | CheckpointSlice]]:
    """The checkpoint's weights under Hugging Face names. Under tensor parallelism, safetensors
    tensors come unread (``CheckpointSlice``): each rank's loaders read only its part of each."""
    tp_size = get_tp_group().world_size
    if model_config.load_format == "gguf":
        if tp_size > 1:
            raise ValueError(gguf_tensor_parallel_message(tp_size))
        return iter_gguf_weights(model_config.path, model_config.dtype)
    if tp_size > 1:
        return iterate_safetensors_slices(model_config.path)
    return iterate_safetensors(model_config.path)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_config: ModelConfig,
    device: torch.device | str,
    platform: type[Platform] = Platform,
    kv_cache_fp8: bool = False,
) -> nn.Module:
    """Build the model in its dtype directly on the device, fill in its weights, then let each
    layer's quantization method put them in the layout of ``platform``'s kernels (the base
    ``Platform``: core's PyTorch kernels). The checkpoint's KV cache scales are set on the
    attention layers where the KV cache is FP8 (``kv_cache_fp8``), and otherwise ignored."""
    model_class = get_model_class(model_config.architecture)
    with torch.device(device), _default_dtype(model_config.dtype):
        model = model_class(model_config)
    if model_config.load_format == "dummy":
        load_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(take_kv_scales(model, iterate_weights(model_config), kv_cache_fp8))
    model.requires_grad_(False).eval()
    process_weights_after_loading(model, platform)
    return model


def process_weights_after_loading(model: nn.Module, platform: type[Platform]) -> None:
    """Each layer with a quantization method (linear layers, the LM head) processes its loaded
    weights for ``platform``."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module, platform)
