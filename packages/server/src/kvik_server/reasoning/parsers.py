"""``<think>...</think>`` reasoning, split from the answer.

As the tool parsers do, a parser reads the whole output so far and says which part is reasoning
and which is the answer; streaming sends what grew (ReasoningStream). Whether the output starts
inside the reasoning depends on the model: DeepSeek-R1 always thinks first (its template may open
the ``<think>`` itself); Qwen3 thinks only when its output opens ``<think>``, or when the prompt
already did (templates of thinking-only models end the prompt with it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""
    #: The reasoning has ended (the answer, and a grammar, start after it).
    ended: bool = False


def _held_back(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    name = ""
    START, END = "<think>", "</think>"
    #: The output is reasoning from its first token, whatever the prompt says.
    always_thinks = False

    def __init__(self, prompt: str | None = None) -> None:
        # A prompt that ends by opening the reasoning puts the output inside it.
        self.starts_inside = self.always_thinks or (prompt or "").rstrip().endswith(self.START)

    def split(self, text: str, final: bool) -> Split:
        stripped = text.lstrip()
        if stripped.startswith(self.START):
            return self._inside(stripped[len(self.START) :], final)
        if not final and self.START.startswith(stripped):
            # Perhaps the start of <think>, or only whitespace so far (which may come before
            # it): sent now, as content or reasoning, it could not be taken back once <think>
            # came and the whole parse dropped it.
            return Split()
        if self.starts_inside:
            return self._inside(text, final)
        return Split(content=text, ended=True)

    def _inside(self, text: str, final: bool) -> Split:
        end = text.find(self.END)
        if end < 0:
            hold = 0 if final else _held_back(text, self.END)
            return Split(reasoning=text[: len(text) - hold])
        content = text[end + len(self.END) :].lstrip()
        return Split(reasoning=text[:end], content=content, ended=True)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_thinks = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


#: ``--reasoning-parser`` names.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


class ReasoningStream:
    """Feeds a model's output, step by step, to a ReasoningParser and says what is new:
    (reasoning, content) text added since the last call."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0

    def feed(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._diff(self.parser.split(self.text, final=False))

    def finish(self) -> tuple[str, str]:
        return self._diff(self.parser.split(self.text, final=True))

    def _diff(self, split: Split) -> tuple[str, str]:
        reasoning = split.reasoning[self.reasoning_sent :]
        content = split.content[self.content_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(split.reasoning))
        self.content_sent = max(self.content_sent, len(split.content))
        return reasoning, content
