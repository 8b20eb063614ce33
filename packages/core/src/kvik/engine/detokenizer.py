"""Incremental detokenisation and stop strings, per request, in the front end.

Text comes out whole: a multi-byte character split over byte-fallback tokens appears once its last
byte arrives, never as U+FFFD halves. Stop strings may span tokens; the text ends exactly before the
stop string (or after it with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

# How many prompt tokens prime the stream, so the first output token decodes with its context
# (e.g. SentencePiece's leading space); a few suffice.
_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's Rust core
        prime = list(prompt_token_ids[-_PRIME_TOKENS:])
        if self.backend is not None:
            self.stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        else:
            # Slow tokenizers: a window of ids (primed as the fast path is) decoded twice a token,
            # up to the text already handed out and up to the newest token; the window moves on
            # once a token completes text, so a token costs the same at any output length.
            self.ids = prime
            self.prefix_offset = 0
            self.read_offset = len(prime)

    def step(self, token_id: int) -> str:
        """Take one new token; return the text it completes (maybe empty)."""
        if self.backend is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        done = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        now = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character kept back
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return now[len(done) :]


def find_stop_string(
    text: str, num_new_chars: int, stops: Sequence[str], include_stop: bool
) -> tuple[str, int] | None:
    """The first stop string that ends in the newest ``num_new_chars`` of ``text``.

    Returns (stop string, length the text is cut to), or None. Only windows that reach into the new
    characters are searched, so each stop is found once, at its first occurrence.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    return stop, at + len(stop) if include_stop else at
