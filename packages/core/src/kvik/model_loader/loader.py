"""Resolve a model folder into a ModelConfig, and build the model with its weights on a device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from kvik.config import ModelConfig, parse_dtype, read_generation_config
from kvik.model_loader.dummy import load_dummy_weights
from kvik.model_loader.safetensors_loader import iterate_safetensors, safetensors_files
from kvik.models.registry import get_model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def load_model_config(
    model: str,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    load_format: str = "auto",
    platform_default_dtype: str | torch.dtype = "float32",
    seed: int = 0,
    tokenizer: str | None = None,
) -> ModelConfig:
    """Read a local model folder's config.json and generation_config.json and check them against
    what was asked for. ``dtype="auto"`` means the platform's default."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model folder {model!r} not found (hub ids and built-in aliases are not supported "
            "yet: pass a local folder with config.json and safetensors weights)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json")
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    max_position = hf_config.max_position_embeddings
    if max_model_len is None:
        max_model_len = max_position
    elif not 0 < max_model_len <= max_position:
        raise ValueError(
            f"max_model_len {max_model_len} must be in 1..{max_position} "
            f"(the model's max_position_embeddings)"
        )
    config = ModelConfig(
        path=path,
        hf_config=hf_config,
        dtype=parse_dtype(platform_default_dtype if dtype == "auto" else dtype),
        max_model_len=max_model_len,
        load_format=load_format,
        tokenizer=tokenizer,
        seed=seed,
        generation_config=read_generation_config(path),
    )
    # Fail here, before an engine is built, on an unsupported architecture or missing weights.
    get_model_class(config.architecture)
    if load_format != "dummy":
        safetensors_files(path)
    return config


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, device: torch.device | str) -> nn.Module:
    """Build the model in its dtype directly on the device, then fill in its weights."""
    model_class = get_model_class(model_config.architecture)
    with torch.device(device), _default_dtype(model_config.dtype):
        model = model_class(model_config)
    if model_config.load_format == "dummy":
        load_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(iterate_safetensors(model_config.path))
    return model.requires_grad_(False).eval()
