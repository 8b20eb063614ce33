"""Sampling defaults from a model's generation config (kvik.model_loader.generation_config): the
``generation_config`` option's sources, the GGUF metadata, and the command line's fallbacks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import pytest
from transformers import LlamaConfig

from kvik.cli.engine_args import add_engine_arguments, add_sampling_arguments, engine_kwargs
from kvik.cli.engine_args import sampling_params as cli_sampling_params
from kvik.model_loader import load_model_config
from kvik.model_loader.generation_config import sampling_defaults
from kvik.model_loader.gguf_loader import gguf_generation_config
from kvik.sampling_params import SamplingParams

QWEN3_LIKE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 7],
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def model_folder(path: Path, generation_config: dict | None) -> Path:
    LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_auto_takes_the_models_sampling_keys_only():
    assert sampling_defaults("auto", QWEN3_LIKE) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_defaults("auto", {"eos_token_id": 2, "temperature": None}) == {}


@pytest.mark.parametrize("option", ["vllm", "none"])
def test_vllm_and_none_mean_kvik_defaults(option):
    assert sampling_defaults(option, QWEN3_LIKE) == {}


def test_a_folder_gives_its_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.1, "max_new_tokens": 64, "eos_token_id": 9})
    )
    defaults = sampling_defaults(str(tmp_path), QWEN3_LIKE)
    assert defaults == {"repetition_penalty": 1.1, "max_new_tokens": 64}


def test_a_folder_without_one_and_bad_options_are_named(tmp_path):
    with pytest.raises(ValueError, match="expected 'auto', 'vllm', 'none' or a folder holding"):
        sampling_defaults(str(tmp_path), {})
    with pytest.raises(ValueError, match="generation_config must be"):
        sampling_defaults(None, {})  # type: ignore[arg-type]


def test_an_unusable_default_fails_at_load_not_at_the_first_request():
    with pytest.raises(ValueError, match="model's generation config gives an invalid sampling"):
        sampling_defaults("auto", {"top_p": 1.5})


@pytest.mark.parametrize(
    "content, message",
    [("{oops", "is not a valid JSON file"), ("[]", "holds a JSON list, not an object")],
    ids=["not-json", "a-list"],
)
def test_a_damaged_generation_config_names_its_file(tmp_path, content, message):
    """json's own error (no file named), or an AttributeError from reading a list, before."""
    folder = model_folder(tmp_path, None)
    (folder / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=f"generation_config.json {message}"):
        load_model_config(str(folder), load_format="dummy")


def test_loader_applies_the_option(tmp_path):
    folder = model_folder(tmp_path, QWEN3_LIKE)
    auto = load_model_config(str(folder), load_format="dummy")
    assert auto.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    own = load_model_config(str(folder), load_format="dummy", generation_config="vllm")
    assert own.sampling_defaults == {}
    assert own.generation_config["eos_token_id"] == [2, 7]  # the stop tokens stay the model's
    assert own.eos_token_ids() == auto.eos_token_ids()


def test_gguf_recommended_sampling_is_read(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_eos_token_id(2)
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = gguf_generation_config(path)
    assert config["eos_token_id"] == 2 and config["top_k"] == 40
    assert config["temperature"] == pytest.approx(0.7)
    assert config["repetition_penalty"] == pytest.approx(1.25)


def cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    add_sampling_arguments(parser)
    return parser.parse_args(argv)


def test_cli_flags_win_then_the_model_then_the_command_lines_defaults():
    model = {"temperature": 0.6, "top_k": 20, "max_new_tokens": 100}
    assert cli_sampling_params(cli([]), {}) == SamplingParams(temperature=0.0, max_tokens=256)
    assert cli_sampling_params(cli([]), model) == SamplingParams(
        temperature=0.6, top_k=20, max_tokens=100
    )
    given = cli(["--temperature", "0", "--max-tokens", "8", "--top-p", "0.5", "--stop", "x"])
    assert cli_sampling_params(given, model) == SamplingParams(
        temperature=0.0, top_k=20, top_p=0.5, max_tokens=8, stop=["x"]
    )


def test_cli_generation_config_flag_reaches_the_engine_args():
    assert engine_kwargs(cli([]))["generation_config"] == "auto"
    assert engine_kwargs(cli(["--generation-config", "vllm"]))["generation_config"] == "vllm"
