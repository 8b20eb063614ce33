"""Model folders to ModelConfigs and models: formats, dtypes, limits and the errors users meet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from kvik.model_loader import load_model, load_model_config
from kvik.model_loader.dummy import DUMMY_RANGE
from kvik.models.registry import get_model_class

CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    architectures=["LlamaForCausalLM"],
)


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    """A model folder with config.json and generation_config.json, but no weights."""
    LlamaConfig(**CONFIG).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    return tmp_path


def test_config_resolves_defaults(config_only: Path, tmp_path_factory) -> None:
    tok = tmp_path_factory.mktemp("tok")
    (tok / "tokenizer.json").write_text("{}")
    config = load_model_config(str(config_only), load_format="dummy", seed=3, tokenizer=str(tok))
    assert config.architecture == "LlamaForCausalLM"
    assert config.dtype == torch.float32
    assert config.max_model_len == 256
    assert (config.seed, config.tokenizer, config.load_format) == (3, str(tok), "dummy")
    with pytest.raises(ValueError, match="tokenizer 'tok' is neither a local folder"):
        load_model_config(str(config_only), load_format="dummy", tokenizer="tok")
    assert config.generation_config == {"eos_token_id": [2, 7]}


def test_auto_dtype_is_the_platform_default(config_only: Path) -> None:
    config = load_model_config(str(config_only), load_format="dummy", platform_default_dtype="bf16")
    assert config.dtype == torch.bfloat16
    config = load_model_config(str(config_only), dtype="float16", load_format="dummy")
    assert config.dtype == torch.float16


def test_dummy_weights_are_deterministic(config_only: Path) -> None:
    config = load_model_config(str(config_only), load_format="dummy", seed=1)
    a, b = load_model(config, torch.device("cpu")), load_model(config, torch.device("cpu"))
    config.seed = 2
    c = load_model(config, torch.device("cpu"))
    params = zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True)
    for (name, pa), pb, pc in params:
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
        assert pa.abs().max() <= DUMMY_RANGE
        assert not pa.requires_grad


def test_model_is_built_in_its_dtype(config_only: Path) -> None:
    config = load_model_config(str(config_only), dtype="bfloat16", load_format="dummy")
    model = load_model(config, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_max_model_len(config_only: Path) -> None:
    assert (
        load_model_config(str(config_only), max_model_len=100, load_format="dummy").max_model_len
        == 100
    )
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model_config(str(config_only), max_model_len=257, load_format="dummy")


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a local folder"):
        load_model_config(str(tmp_path / "nowhere"))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        load_model_config(str(tmp_path))


def test_folder_without_weights(config_only: Path) -> None:
    with pytest.raises(ValueError, match=r"no weights: looked for model.safetensors.index.json"):
        load_model_config(str(config_only))


def test_unknown_load_format(config_only: Path) -> None:
    with pytest.raises(ValueError, match="load_format"):
        load_model_config(str(config_only), load_format="pickle")


def test_unknown_architecture(tmp_path: Path) -> None:
    LlamaConfig(**{**CONFIG, "architectures": ["NotAModelForCausalLM"]}).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match="'NotAModelForCausalLM' is not supported.*LlamaForCausalLM"
    ):
        load_model_config(str(tmp_path), load_format="dummy")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("{not json", "is not a valid JSON file"),
        ('{"num_attention_heads": 5}', "not a multiple of the number of attention heads"),
    ],
    ids=["not-json", "heads-do-not-split"],
)
def test_damaged_config(config_only: Path, damage: str, message: str) -> None:
    """transformers' own errors (several kinds, one a traceback through its validators) become
    one ValueError naming the folder."""
    config = config_only / "config.json"
    if damage.startswith("{not"):
        config.write_text(damage)
    else:
        config.write_text(json.dumps({**json.loads(config.read_text()), **json.loads(damage)}))
    with pytest.raises(ValueError, match=f"config.json is not a configuration.*{message}"):
        load_model_config(str(config_only), load_format="dummy")


@pytest.mark.parametrize("keep", [1000, 20000], ids=["header", "data"])
def test_damaged_weights_name_the_file(config_only: Path, keep: int) -> None:
    """A cut download: safetensors' error becomes one naming the file."""
    from safetensors.torch import save_file

    weights = {"model.embed_tokens.weight": torch.zeros(128, 4096)}
    save_file(weights, str(config_only / "model.safetensors"))
    data = (config_only / "model.safetensors").read_bytes()
    (config_only / "model.safetensors").write_bytes(data[:keep])
    config = load_model_config(str(config_only))
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_model(config, torch.device("cpu"))


def test_registry_resolves_registered_architectures() -> None:
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
