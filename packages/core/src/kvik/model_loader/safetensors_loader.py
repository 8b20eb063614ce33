"""Weights from a folder's safetensors files, memory-mapped and read one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import Tensor

from kvik.model_loader.weight_slice import CheckpointSlice

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(folder: Path) -> list[Path]:
    """The shards listed by ``model.safetensors.index.json``, else ``model.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise ValueError(
        f"model folder {folder} has no weights: looked for {INDEX_FILE} and {SINGLE_FILE}"
    )


def unreadable(file: Path, error: SafetensorError) -> ValueError:
    """A damaged checkpoint file (a cut download, another format under the name) as a clear
    error naming it, not safetensors' own."""
    return ValueError(f"{file} is not a readable safetensors file ({error}): download it again")


def iterate_safetensors(folder: Path) -> Iterator[tuple[str, Tensor]]:
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise unreadable(file, e) from e


def iterate_safetensors_slices(folder: Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """The checkpoint's tensors unread, for ranks that load only their part of each
    (kvik.model_loader.weight_slice). A slice reads from its file while the iterator is on that
    file: the model's loaders read each as it comes."""
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    yield name, CheckpointSlice(name, f)
        except SafetensorError as e:
            raise unreadable(file, e) from e
