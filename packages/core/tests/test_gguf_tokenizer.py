"""The GGUF tokenizer kvik builds with ``tokenizers``: llama.cpp's pre-tokenizer splits, control
and user-defined tokens, bos added where the GGUF asks. (The default model's tokenizer against
transformers' own GGUF loading is in test_gguf.py.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf import TokenType
from tokenizers import pre_tokenizers

from kvik.model_loader.gguf_loader import gguf_tokenizer
from kvik.model_loader.gguf_tokenizer import PRE_TOKENIZERS

TEXT = "I've 12345 apples\n\n  and Ünïcode!"


#: How each pre-tokenizer splits TEXT, the pieces between "|".
SPLITS = {
    # GPT-2: digits in one run, "'ve" apart, a space joins the next word, and a run of whitespace
    # all but its last space
    "gpt-2": "I|'ve| 12345| apples|\n\n | and| Ünïcode|!",
    # SmolLM2: every digit alone, else GPT-2's pattern
    "smollm": "I|'ve| |1|2|3|4|5| apples|\n\n | and| Ünïcode|!",
    # Llama 3: digits in threes, newlines apart from the spaces after them
    "llama-bpe": "I|'ve| |123|45| apples|\n\n| | and| Ünïcode|!",
    # Qwen2: every digit alone, else Llama 3's pattern
    "qwen2": "I|'ve| |1|2|3|4|5| apples|\n\n| | and| Ünïcode|!",
}


@pytest.mark.parametrize("name", SPLITS)
def test_pre_tokenizer_splits_as_llama_cpp(name: str) -> None:
    pieces = SPLITS[name].split("|")
    assert "".join(pieces) == TEXT
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # each piece alone through the byte mapping gives the same characters as the whole text
    want = [byte_level.pre_tokenize_str(p)[0][0] for p in pieces]
    got = [text for text, _ in PRE_TOKENIZERS[name]().pre_tokenize_str(TEXT)]
    assert got == want


def _write_vocab(path: Path, pre: str | None, add_bos: bool) -> list[str]:
    """A byte-level BPE vocabulary: the 256 byte characters, two merges, two control tokens and a
    user-defined one, in a GGUF with no tensors."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, "Ġt", "he", "Ġthe", "<|begin|>", "<|end|>", "<tool>"]
    types = [TokenType.NORMAL] * (len(tokens) - 3) + [TokenType.CONTROL] * 2
    types.append(TokenType.USER_DEFINED)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(tokens.index("<|begin|>"))
    writer.add_eos_token_id(tokens.index("<|end|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(
        "{% for m in messages %}<|begin|>{{ m['content'] }}<|end|>{% endfor %}"
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


@pytest.mark.parametrize("add_bos", [False, True], ids=["no-bos", "bos"])
def test_written_vocabulary_encodes_and_decodes(tmp_path: Path, add_bos: bool) -> None:
    path = tmp_path / "vocab.gguf"
    tokens = _write_vocab(path, "llama-bpe", add_bos)
    tokenizer = gguf_tokenizer(path)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|begin|>", "<|end|>")

    text = "the the<tool> 2025<|end|>"
    ids = tokenizer(text)["input_ids"]
    expected = ["t", "he", "Ġthe", "<tool>", "Ġ", "2", "0", "2", "5", "<|end|>"]
    assert ids == [tokens.index("<|begin|>")] * add_bos + [tokens.index(t) for t in expected]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the the<tool> 2025"
    assert tokenizer.decode(ids) == "<|begin|>" * add_bos + text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "<|begin|>hi<|end|>"


@pytest.mark.parametrize("pre", ["some-future-vocab", None], ids=["unknown", "absent"])
def test_unknown_pre_tokenizer_goes_through_transformers(
    tmp_path: Path, monkeypatch, pre: str | None
) -> None:
    """A pre-tokenizer kvik has no table entry for (or none named) is left to transformers' public
    GGUF loading, not split with a guess; the GGUF's special tokens and chat template still apply."""
    from kvik.model_loader import gguf_tokenizer as module

    path = tmp_path / "vocab.gguf"
    tokens = _write_vocab(path, pre, add_bos=False)
    asked = []
    real = module.transformers_gguf_tokenizer
    monkeypatch.setattr(module, "transformers_gguf_tokenizer", lambda p: asked.append(p) or real(p))
    tokenizer = gguf_tokenizer(path)
    assert asked == [path]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|begin|>", "<|end|>")
    assert tokenizer("the<|end|>")["input_ids"] == [
        tokens.index("t"),
        tokens.index("he"),
        tokens.index("<|end|>"),
    ]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "<|begin|>hi<|end|>"
