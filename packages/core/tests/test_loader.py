"""Model folders to ModelConfigs and models: formats, dtypes, limits and the errors users meet."""

from __future__ import annotations

import json
import re
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


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
        ({"sliding_window": -5}, "sliding_window must be an integer >= 0, got -5"),
    ],
    ids=["kv-heads-do-not-divide", "no-kv-heads", "no-positions", "negative-window"],
)
def test_config_sizes_the_model_cannot_have(config_only: Path, change: dict, message: str) -> None:
    """Sizes transformers accepts, refused naming config.json (they were a weight shape error, a
    ZeroDivisionError, the scheduler's max_model_len, or a model that loaded)."""
    config = config_only / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        load_model_config(str(config_only), load_format="dummy")


@pytest.fixture
def checkpoint(config_only: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint of CONFIG, as transformers names them."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}


O_PROJ = "model.layers.1.self_attn.o_proj.weight"


def _widen(tensors: dict, name: str, dim: int, extra: int) -> None:
    shape = list(tensors[name].shape)
    shape[dim] = extra
    tensors[name] = torch.cat([tensors[name], torch.randn(shape)], dim)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda t: _widen(t, O_PROJ, 1, 16),
            "shape (32, 48) has 48 along dim 1, where model.layers.1.self_attn.o_proj takes 32",
        ),
        (
            lambda t: _widen(t, "model.layers.0.self_attn.k_proj.weight", 0, 8),
            "shape (24, 32) has 24 along dim 0, where model.layers.0.self_attn.qkv_proj takes 16",
        ),
        (
            lambda t: _widen(t, "model.layers.0.mlp.up_proj.weight", 0, 8),
            "has 72 along dim 0, where model.layers.0.mlp.gate_up_proj takes 64",
        ),
        (
            lambda t: t.update({O_PROJ: torch.ones(32, 32, dtype=torch.int8)}),
            "checkpoint dtype torch.int8 where the parameter is torch.float32",
        ),
        (lambda t: t.update({O_PROJ: t[O_PROJ] > 0}), "checkpoint dtype torch.bool"),
        (
            lambda t: t.update({O_PROJ: t[O_PROJ].to(torch.float8_e4m3fn)}),
            "FP8 weights need their scales",
        ),
    ],
    ids=["wider", "taller-k", "taller-up", "int8", "bool", "fp8-unscaled"],
)
def test_weights_a_cast_or_a_cut_would_change_are_refused(
    config_only: Path, checkpoint: dict, damage, message: str
) -> None:
    """A tensor larger than its layer along the split dim lost its extra rows or columns; an
    integer, boolean or unscaled FP8 tensor was cast: each model loaded, wrong."""
    from safetensors.torch import save_file

    damage(checkpoint)
    save_file(checkpoint, str(config_only / "model.safetensors"))
    config = load_model_config(str(config_only))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(config, torch.device("cpu"))


def _save_sharded(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_tensor_in_two_shards_is_refused(config_only: Path, checkpoint: dict) -> None:
    """The later shard's copy silently replaced the first."""
    from safetensors.torch import save_file

    _save_sharded(config_only, checkpoint)
    first = sorted(checkpoint)[0]
    b = {k: v for k, v in checkpoint.items() if k > sorted(checkpoint)[len(checkpoint) // 2 - 1]}
    save_file({**b, first: torch.zeros_like(checkpoint[first])}, str(config_only / "b.safetensors"))
    config = load_model_config(str(config_only))
    with pytest.raises(ValueError, match=f"'{first}' is in the checkpoint twice"):
        load_model(config, torch.device("cpu"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda f: (f / "b.safetensors").unlink(),
            "lists weight files the folder does not have: b.safetensors",
        ),
        (
            lambda f: (f / "model.safetensors.index.json").write_text("{oops"),
            "is not a safetensors index.*JSONDecodeError",
        ),
        (
            lambda f: (f / "model.safetensors.index.json").write_text("{}"),
            "is not a safetensors index.*KeyError: 'weight_map'",
        ),
    ],
    ids=["missing-shard", "not-json", "no-weight-map"],
)
def test_damaged_index_is_named_before_the_engine(
    config_only: Path, checkpoint: dict, damage, message: str
) -> None:
    """A missing shard was a FileNotFoundError once the engine read it; a damaged index json's
    or a KeyError naming no file."""
    _save_sharded(config_only, checkpoint)
    damage(config_only)
    with pytest.raises(ValueError, match=f"model.safetensors.index.json {message}"):
        load_model_config(str(config_only))


def test_unreadable_weights_are_named(config_only: Path, checkpoint: dict, monkeypatch) -> None:
    """safetensors reports a file it may not open as "No such file or directory". (The test may
    run as root, whom a file's mode does not stop: the permission check is replaced.)"""
    from safetensors.torch import save_file

    from kvik.model_loader import safetensors_loader

    save_file(checkpoint, str(config_only / "model.safetensors"))
    monkeypatch.setattr(safetensors_loader.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="no permission to read .*model.safetensors"):
        load_model_config(str(config_only))


@pytest.mark.parametrize(
    "file, content, message",
    [
        ("tokenizer.json", "{oops", "JSONDecodeError"),
        ("tokenizer.json", '{"model": {"type": "BPE"}}', "KeyError: 'added_tokens'"),
    ],
    ids=["not-json", "not-a-tokenizer"],
)
def test_damaged_tokenizer_names_its_folder(tmp_path: Path, file: str, content: str, message: str):
    """transformers' errors from deep inside (json's, a KeyError) name the folder now."""
    from kvik.engine.input_processor import load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / file).write_text(content)
    with pytest.raises(ValueError, match=f"the tokenizer in {tmp_path} does not load.*{message}"):
        load_tokenizer(tmp_path)


def test_registry_resolves_registered_architectures() -> None:
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
