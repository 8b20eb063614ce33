"""Model names to files: the built-in alias (or no name) for the default model, a local folder, a
local ``.gguf`` file, or a Hugging Face hub id when a network exists."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvik.model_loader.default_model import ALIAS, default_model_path

# What a safetensors model folder needs from a hub repo; the rest (other formats, images) is skipped.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.*",
]
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the folder with config.json, or the .gguf file
    kind: Literal["folder", "gguf"]
    display_name: str  # the name the user gave (the alias for the default model)


def resolve_model(name: str | None) -> ResolvedModel:
    """Resolve a model name, in this order: None or the alias, an existing local folder or
    ``.gguf`` file, a hub id ``org/name``. Raises ValueError saying what was tried."""
    if name is None or name == ALIAS:
        return ResolvedModel(default_model_path(), "gguf", ALIAS)
    if not name.strip():
        # Path("") is the current folder: an empty name (an unset variable in a script) would
        # load whatever model happens to sit there.
        raise ValueError("model name is empty: give a folder, a .gguf file, a hub id or the alias")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        return ResolvedModel(path.resolve(), "folder", name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        return ResolvedModel(path.resolve(), "gguf", name)
    if _HUB_ID.fullmatch(name):
        return ResolvedModel(_hub_download(name), "folder", name)
    raise ValueError(
        f"model {name!r} is neither a local folder, a .gguf file, the alias {ALIAS!r} "
        "nor a hub id of the form org/name"
    )


def _hub_download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # no network, no such repo, gated, offline mode: all mean "not here"
        raise ValueError(
            f"model {repo_id!r} is neither a local folder, a .gguf file, the alias {ALIAS!r} "
            f"nor a reachable hub id ({type(e).__name__}: {e})"
        ) from e
    if not (folder / "config.json").is_file():
        raise ValueError(f"hub repo {repo_id!r} has no config.json (kvik loads safetensors repos)")
    return folder


#: Files of a folder that hold a tokenizer (``kvik.engine.input_processor.load_tokenizer``).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer(name: str) -> str:
    """The ``tokenizer`` option: a local folder holding a tokenizer, a ``.gguf`` file, or a hub id
    ``org/name`` (its tokenizer files are downloaded). Raises ValueError saying what was tried,
    rather than leave the model without a tokenizer."""
    if not name.strip():
        raise ValueError("tokenizer name is empty: give a folder, a .gguf file or a hub id")
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(
                f"tokenizer folder {path} holds no tokenizer ({', '.join(TOKENIZER_FILES)})"
            )
        return str(path.resolve())
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"tokenizer {path} is a file but not a .gguf file: pass its folder")
        return str(path.resolve())
    if _HUB_ID.fullmatch(name):
        from huggingface_hub import snapshot_download

        patterns = ["tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt"]
        try:
            folder = Path(snapshot_download(name, allow_patterns=[*patterns, "chat_template.*"]))
        except Exception as e:  # no network, no such repo, gated, offline mode
            raise ValueError(
                f"tokenizer {name!r} is neither a local folder, a .gguf file nor a reachable hub "
                f"id ({type(e).__name__}: {e})"
            ) from e
        return resolve_tokenizer(str(folder))
    raise ValueError(
        f"tokenizer {name!r} is neither a local folder, a .gguf file nor a hub id of the form "
        "org/name"
    )
