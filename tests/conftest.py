"""Shared fixtures for the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(kind) -> folder of a saved random-weight model ('llama', 'mistral', 'qwen2', 'qwen3')."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return make
