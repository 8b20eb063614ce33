"""GGUF files (llama.cpp's format): the model config, weights, tokenizer and generation defaults,
all read from the one file (kvik.model_loader.gguf_file parses it, gguf_dequant dequantizes)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvik.model_loader.gguf_dequant import dequantize
from kvik.model_loader.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp's tensor names (gguf's MODEL_TENSOR names) to Hugging Face's, for the Llama family.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@functools.lru_cache(maxsize=2)
def _open(path: Path, stamp: tuple[int, int]) -> GGUFFile:
    del stamp  # part of the cache key only: a replaced file is read again
    try:
        return GGUFFile(path)
    except ValueError as e:
        raise ValueError(f"{e}: download it again") from e


def _reader(path: str | Path) -> GGUFFile:
    # A model load asks for the config, tokenizer, generation config and weights one after
    # another: the file is parsed once.
    path = Path(path).resolve()
    stat = path.stat()
    return _open(path, (stat.st_mtime_ns, stat.st_size))


def _metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def _architecture(reader: GGUFFile, path: str | Path) -> str:
    arch = _metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def gguf_hf_config(path: str | Path) -> Any:  # -> transformers.PretrainedConfig
    """The Hugging Face config that the GGUF metadata describes."""
    from transformers import LlamaConfig

    reader = _reader(path)
    arch = _architecture(reader, path)
    if _metadata(reader, f"{arch}.rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: GGUF rope scaling is not supported yet")

    def meta(key: str, default: Any = None) -> Any:
        return _metadata(reader, f"{arch}.{key}", default)

    num_heads = meta("attention.head_count")
    extra = {}
    if (head_dim := meta("attention.key_length")) is not None:
        extra["head_dim"] = head_dim
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=meta("vocab_size") or len(_metadata(reader, "tokenizer.ggml.tokens")),
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=meta("attention.head_count_kv", num_heads),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        rope_theta=meta("rope.freq_base", 10000.0),
        max_position_embeddings=meta("context_length"),
        # llama.cpp writes no output.weight when the head shares the embedding
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_metadata(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_metadata(reader, "tokenizer.ggml.padding_token_id"),
        **extra,
    )


#: llama.cpp's recommended-sampling metadata -> the generation_config.json key it stands for.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def gguf_generation_config(path: str | Path) -> dict[str, Any]:
    """generation_config.json's content as far as the GGUF says it: bos, pad, every token that
    ends generation (llama.cpp's eos plus its end-of-turn and end-of-message tokens), and the
    sampling its author recommends (``general.sampling.*``) where it says."""
    reader = _reader(path)
    config: dict[str, Any] = {
        ours: _metadata(reader, key)
        for key, ours in _SAMPLING_KEYS.items()
        if _metadata(reader, key) is not None
    }
    for key in ("bos", "pad"):
        token = _metadata(reader, f"tokenizer.ggml.{'padding' if key == 'pad' else key}_token_id")
        if token is not None:
            config[f"{key}_token_id"] = token
    eos = [_metadata(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(token for token in eos if token is not None))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def gguf_has_tokenizer(path: str | Path) -> bool:
    return "tokenizer.ggml.tokens" in _reader(path).metadata


def gguf_tokenizer(path: str | Path) -> Any:  # -> a transformers fast tokenizer
    """The tokenizer and chat template stored in the GGUF (kvik.model_loader.gguf_tokenizer)."""
    from kvik.model_loader.gguf_tokenizer import gguf_tokenizer_from_reader

    return gguf_tokenizer_from_reader(_reader(path), Path(path))


def _hf_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that kvik knows")


def _unpermute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py interleaves each head's two rotary halves (rows [h, 2, d] -> [h, d, 2])
    # for llama.cpp's rope kernel; Hugging Face's rotate_half wants them apart again.
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def iter_gguf_weights(path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF under its Hugging Face name and shape, dequantised to ``dtype``."""
    reader = _reader(path)
    arch = _architecture(reader, path)
    n_head = _metadata(reader, f"{arch}.attention.head_count")
    n_kv_head = _metadata(reader, f"{arch}.attention.head_count_kv", n_head)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        try:
            # F32/F16 come back as they are; block-quantised types and BF16 as float32
            weight = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            raise ValueError(f"{path}: tensor {tensor.name} of type {kind}: {e}") from e
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dim first
        weight = weight.reshape(shape)
        if name.endswith("self_attn.q_proj.weight"):
            weight = _unpermute_rotary(weight, n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            weight = _unpermute_rotary(weight, n_kv_head)
        yield name, weight.to(dtype)
