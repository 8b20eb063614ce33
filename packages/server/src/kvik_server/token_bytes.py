"""A token's own UTF-8 bytes, for the chat logprobs' ``bytes`` field."""

from __future__ import annotations

import functools
from typing import Any


class TokenBytes:
    """A token's own UTF-8 bytes, which OpenAI's ``bytes`` are for: a character split over
    several tokens is whole only in their bytes joined. A token holding part of a character
    decodes alone to U+FFFD, whose bytes (EF BF BD) are what the logprobs said; a byte-level
    BPE (GPT-2's, Llama 3's, Qwen's, SmolLM's) and a byte-fallback vocabulary (``<0xE6>``:
    Llama 2's, Mistral's) know the true ones. Other tokenizers: the decoded text's bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = None
        decoder = getattr(getattr(tokenizer, "_tokenizer", None), "decoder", None)
        if decoder is not None:
            state = decoder.__getstate__()
            if b'"ByteLevel"' in state:
                self.kind = "byte_level"
            elif b'"ByteFallback"' in state:
                self.kind = "byte_fallback"
        self.added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
        self.cache: dict[int, list[int] | None] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        if token_id not in self.cache:
            self.cache[token_id] = self._bytes(token_id)
        found = self.cache[token_id]
        return list(text.encode()) if found is None else found

    def _bytes(self, token_id: int) -> list[int] | None:
        if self.kind is None or token_id in self.added:
            return None
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except (IndexError, OverflowError, TypeError):
            return None
        if not isinstance(piece, str):
            return None
        if self.kind == "byte_level":
            table = _byte_level_table()
            if not all(char in table for char in piece):
                return None
            return [table[char] for char in piece]
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return [int(piece[3:5], 16)]
            except ValueError:
                return None
        return list(piece.replace("\u2581", " ").encode())


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, reversed."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in chars.items()}
