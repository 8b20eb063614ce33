"""Configs read, and unpickled in another process, without transformers' generated docstrings:
the same configs, none of the auto-modeling modules imported, transformers left as it was."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from kvik.config import ModelConfig
from kvik.model_loader import load_model_config

#: What the docstring step imports: a process that reads a config should not need them.
MODELING_MODULES = ("transformers.models.auto.modeling_auto", "torch._dynamo")

READ_CONFIG = """
import json, sys
from kvik.model_loader import load_model_config
import importlib
docstrings = importlib.import_module("transformers.utils.auto_docstring")
before = docstrings.auto_class_docstring
if sys.argv[1] == "default":
    config = load_model_config(None)
else:  # a folder with a config and no weights
    config = load_model_config(sys.argv[1], load_format="dummy")
print(json.dumps({
    "config": config.hf_config.to_dict(),
    "imported": [m for m in sys.argv[2:] if m in sys.modules],
    "restored": docstrings.auto_class_docstring is before,
}))
"""

UNPICKLE = """
import json, pickle, sys
config = pickle.loads(sys.stdin.buffer.read())
print(json.dumps({
    "class": type(config.hf_config).__name__,
    "config": config.hf_config.to_dict(),
    "imported": [m for m in sys.argv[1:] if m in sys.modules],
}))
"""


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(folder)  # fmt: skip
    return folder


def run_python(code: str, *args: str, stdin: bytes | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", code, *args], input=stdin, capture_output=True, timeout=300
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["default", "qwen3-folder"])
def test_a_fresh_process_reads_the_config_without_the_modeling_modules(
    model: str, qwen3_folder: Path
) -> None:
    target = "default" if model == "default" else str(qwen3_folder)
    report = run_python(READ_CONFIG, target, *MODELING_MODULES)
    assert report["imported"] == []
    assert report["restored"]
    # The same config as this process reads.
    if model == "default":
        expected = load_model_config(None).hf_config
    else:
        expected = load_model_config(str(qwen3_folder), load_format="dummy").hf_config
    assert report["config"] == json.loads(json.dumps(expected.to_dict()))


def test_a_model_config_unpickles_in_another_process_without_the_modeling_modules(
    qwen3_folder: Path,
) -> None:
    config = load_model_config(str(qwen3_folder), dtype="float32", load_format="dummy")
    report = run_python(UNPICKLE, *MODELING_MODULES, stdin=pickle.dumps(config))
    assert report["class"] == "Qwen3Config"
    assert report["config"] == json.loads(json.dumps(config.hf_config.to_dict()))
    assert report["imported"] == []


def test_pickling_keeps_every_field(qwen3_folder: Path) -> None:
    config = load_model_config(
        str(qwen3_folder), dtype="bfloat16", max_model_len=256, seed=7, load_format="dummy"
    )
    copy = pickle.loads(pickle.dumps(config))
    assert isinstance(copy, ModelConfig)
    assert type(copy.hf_config) is type(config.hf_config)
    assert copy.hf_config.to_dict() == config.hf_config.to_dict()
    for name, value in vars(config).items():
        if name != "hf_config":
            assert getattr(copy, name) == value, name
    assert copy.dtype is torch.bfloat16
