"""Weights from a folder's safetensors files, memory-mapped and read one tensor at a time."""

from __future__ import annotations

import json
import os
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
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [folder / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{index} is not a safetensors index (a JSON object whose 'weight_map' maps "
                f"tensor names to files): {type(e).__name__}: {e}"
            ) from None
        if absent := [file.name for file in files if not file.is_file()]:
            raise ValueError(
                f"{index} lists weight files the folder does not have: {', '.join(absent)}"
            )
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        raise ValueError(
            f"model folder {folder} has no weights: looked for {INDEX_FILE} and {SINGLE_FILE}"
        )
    # safetensors reports a file it may not open as "No such file or directory".
    if denied := [str(file) for file in files if not os.access(file, os.R_OK)]:
        raise ValueError(f"no permission to read {', '.join(denied)}")
    return files


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
