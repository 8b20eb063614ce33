"""Tool calls streamed as the openai client assembles them: each call's first delta carries its
``index``, ``id``, ``type`` and function ``name``; the following ones carry fragments of its
``arguments``, which concatenate to the whole arguments text."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvik_server.tools.parsers import Parsed, ToolParser


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class FinishedCall:
    id: str
    name: str
    arguments: str


@dataclass
class ToolDelta:
    """What one step adds: answer text, and tool-call deltas shaped as OpenAI's."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream:
    """Feeds a model's output text, step by step, to a ToolParser and says what is new."""

    def __init__(self, parser: ToolParser, parallel_tool_calls: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel_tool_calls
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments_sent: list[int] = []

    def feed(self, text: str) -> ToolDelta:
        self.text += text
        return self._diff(self.parser.parse(self.text, final=False))

    def finish(self) -> ToolDelta:
        """The end of the output: what remains to send. Output that turned out not to be a call
        is sent as content, unless a call was already streamed (which cannot be taken back)."""
        parsed = self.parser.parse(self.text, final=True)
        if not parsed.calls and self.ids:
            return ToolDelta()
        return self._diff(parsed)

    @property
    def calls(self) -> list[FinishedCall]:
        """The calls streamed so far, whole (what the non-streamed answer would hold)."""
        parsed = self.parser.parse(self.text, final=True)
        return [
            FinishedCall(id_, name, call.arguments)
            for id_, name, call in zip(self.ids, self.names, parsed.calls)
        ]

    def _diff(self, parsed: Parsed) -> ToolDelta:
        delta = ToolDelta()
        if len(parsed.content) > self.content_sent and not self.ids:
            delta.content = parsed.content[self.content_sent :]
            self.content_sent = len(parsed.content)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        for index, call in enumerate(calls):
            if index == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(tool_call_id())
                self.names.append(call.name)
                self.arguments_sent.append(0)
                delta.tool_calls.append(
                    {
                        "index": index,
                        "id": self.ids[index],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            new = call.arguments[self.arguments_sent[index] :]
            if new:
                self.arguments_sent[index] = len(call.arguments)
                delta.tool_calls.append({"index": index, "function": {"arguments": new}})
        return delta
