"""The tokenizer a GGUF file stores, built through public APIs only.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen2) whose
pre-tokenizer kvik knows are built directly with the ``tokenizers`` package from the metadata that
kvik's ``GGUFFile`` has already parsed, splitting text the way llama.cpp does for that vocabulary.
Every other vocabulary (SentencePiece ones such as Llama 2's, other or no pre-tokenizer) goes through
transformers' public GGUF loading, ``AutoTokenizer.from_pretrained(..., gguf_file=...)``, which
parses the file a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from kvik.model_loader.gguf_file import GGUFFile

# The splitting patterns of llama.cpp's "llama-bpe" and "qwen2" pre-tokenizers (the same as the
# Hugging Face tokenizer.json of Llama 3 and Qwen2): they differ only in how many digits stay
# together.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(use_regex: bool) -> pre.ByteLevel:
    return pre.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre.PreTokenizer:
    return pre.Sequence(
        [pre.Split(Regex(pattern), behavior="isolated", invert=False), _byte_level(False)]
    )


#: llama.cpp's name for a pre-tokenizer (``tokenizer.ggml.pre``) -> the same split in ``tokenizers``.
PRE_TOKENIZERS: dict[str, Callable[[], pre.PreTokenizer]] = {
    "gpt-2": lambda: _byte_level(True),  # GPT-2's own pattern, which ByteLevel carries
    "smollm": lambda: pre.Sequence([pre.Digits(individual_digits=True), _byte_level(True)]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_PATTERN),
    "qwen2": lambda: _split_then_bytes(_QWEN2_PATTERN),
}


def _metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(f"tokenizer.{key}", default)


def _special_token(reader: GGUFFile, tokens: list[str], name: str) -> str | None:
    token_id = _metadata(reader, f"ggml.{name}_token_id")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _byte_level_bpe(reader: GGUFFile, pre_tokenizer: pre.PreTokenizer) -> Tokenizer:
    tokens: list[str] = _metadata(reader, "ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in _metadata(reader, "ggml.merges", [])]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    if _metadata(reader, "ggml.pre") == "qwen2":
        backend.normalizer = normalizers.NFC()  # as Qwen2's own tokenizer.json
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|> and the like) are matched whole in the text and are special;
    # user-defined ones are matched whole but kept when decoding.
    types = _metadata(reader, "ggml.token_type", [])
    control = [t for t, kind in zip(tokens, types) if kind == TokenType.CONTROL]
    user = [t for t, kind in zip(tokens, types) if kind == TokenType.USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos, eos = (_special_token(reader, tokens, name) for name in ("bos", "eos"))
    add_bos = bool(_metadata(reader, "ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_metadata(reader, "ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        first, last = ([bos] if add_bos else []), ([eos] if add_eos else [])
        ids = [(t, tokens.index(t)) for t in dict.fromkeys(first + last)]
        backend.post_processor = processors.TemplateProcessing(
            single=[*first, "$A", *last], pair=[*first, "$A", *last, *first, "$B", *last],
            special_tokens=ids,
        )  # fmt: skip
    return backend


def gguf_tokenizer_from_reader(reader: GGUFFile, path: Path) -> Any:
    """The GGUF's tokenizer as a transformers fast tokenizer, with its chat template and the
    special tokens the GGUF names by id (which win over any converter's guesses)."""
    from transformers import PreTrainedTokenizerFast

    tokens = _metadata(reader, "ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens metadata)")
    # No tokenizer.ggml.pre: llama.cpp then splits its own "default" way, which kvik does not copy
    make_pre = PRE_TOKENIZERS.get(_metadata(reader, "ggml.pre"))
    if _metadata(reader, "ggml.model") == "gpt2" and make_pre is not None:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=_byte_level_bpe(reader, make_pre()),
            clean_up_tokenization_spaces=False,
        )
    else:
        tokenizer = transformers_gguf_tokenizer(path)
    for name in ("bos", "eos", "unk", "pad"):
        key = "padding" if name == "pad" else "unknown" if name == "unk" else name
        if (token := _special_token(reader, tokens, key)) is not None:
            setattr(tokenizer, f"{name}_token", token)
    # No WordPiece clean-up: it would strip the spaces a byte-level BPE keeps before punctuation.
    tokenizer.clean_up_tokenization_spaces = False
    if not tokenizer.chat_template:
        tokenizer.chat_template = _metadata(reader, "chat_template")
    return tokenizer


def transformers_gguf_tokenizer(path: Path) -> Any:
    """transformers' own (public) GGUF tokenizer loading, for the vocabularies kvik does not build."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False
    )
