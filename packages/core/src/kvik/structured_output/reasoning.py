"""Where a reasoning model's thinking ends, so that a grammar constrains only the answer.

``--reasoning-parser`` names the model family; for these, reasoning is the text up to the end
token, and the grammar starts at the token after it. (The server's reasoning text parsers split
the same text into ``reasoning_content`` and ``content``.)
"""

from __future__ import annotations

from typing import Any

#: reasoning parser -> (the token that opens reasoning, the token that ends it)
REASONING_TOKENS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
}


class ReasoningEnd:
    """The end-of-reasoning token id of a parser, looked up in the tokenizer's vocabulary."""

    def __init__(self, parser: str, tokenizer: Any) -> None:
        if parser not in REASONING_TOKENS:
            raise ValueError(
                f"unknown reasoning parser {parser!r}; known: {', '.join(sorted(REASONING_TOKENS))}"
            )
        vocab = tokenizer.get_vocab()
        start, end = REASONING_TOKENS[parser]
        if end not in vocab:
            raise ValueError(
                f"reasoning parser {parser!r} needs the token {end!r}, which the tokenizer lacks"
            )
        self.start_id = vocab.get(start)
        self.end_id = vocab[end]

    def ended_in_prompt(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt already closed the reasoning (a chat template that turns thinking
        off writes an empty ``<think></think>``): the last end token comes after the last start."""
        last_end = _last_index(prompt_token_ids, self.end_id)
        if last_end < 0:
            return False
        return self.start_id is None or last_end > _last_index(prompt_token_ids, self.start_id)


def _last_index(ids: list[int], value: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == value:
            return i
    return -1
