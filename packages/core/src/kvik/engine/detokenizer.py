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
# How DecodeStream's error starts when the text so far no longer begins with what it handed out.
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's Rust core
        prime = list(prompt_token_ids[-_PRIME_TOKENS:])
        if self.backend is not None:
            self.prime = prime
            self.stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
            # The ids stepped since the stream last gave text (the bytes of a character so far).
            self.pending: list[int] = []
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
            try:
                text = self.stream.step(self.backend, token_id)
            except Exception as e:
                if not str(e).startswith(_INVALID_PREFIX):
                    raise
                return self._restart(token_id)
            if text:
                self.pending.clear()
            else:
                self.pending.append(token_id)
            return text or ""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        done = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        now = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character kept back
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return now[len(done) :]

    def _restart(self, token_id: int) -> str:
        """A new stream, primed as the first was, for the ids since the last text and this one.

        A byte-fallback tokenizer (Llama 2, Mistral, Gemma) decodes a run of byte tokens that is
        not UTF-8 as one U+FFFD per byte, the bytes before it included: a model that writes an
        invalid sequence (a lone lead byte, then a word) turns text the stream already handed
        out into U+FFFD, and DecodeStream raises "Invalid prefix encountered". That exception
        ended the server's output loop, failing every request in flight (as vLLM, the stream
        starts again instead). The text handed out stays; what follows decodes on its own.
        """
        ids, self.pending = [*self.pending, token_id], []
        self.stream = DecodeStream(ids=self.prime, skip_special_tokens=self.skip_special_tokens)
        text = ""
        for i in ids:
            try:
                chunk = self.stream.step(self.backend, i)
            except Exception as e:
                if not str(e).startswith(_INVALID_PREFIX):
                    raise
                # The replayed ids hold such a sequence themselves: go on from this id alone.
                self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
                chunk = self.stream.step(self.backend, i)
            if chunk:
                text += chunk
                self.pending.clear()
            else:
                self.pending.append(i)
        return text


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
