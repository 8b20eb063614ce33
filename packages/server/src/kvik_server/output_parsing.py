"""A choice's output read as reasoning, answer and tool calls: once whole (``parse``) or as it
streams (``feed`` each step's text, then ``finish``). Reasoning is split off first; tool calls
are looked for in what follows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvik_server.reasoning.parsers import REASONING_PARSERS, ReasoningParser, ReasoningStream
from kvik_server.tools.choice import ToolPlan
from kvik_server.tools.parsers import ToolParser
from kvik_server.tools.stream import FinishedCall, ToolCallStream, tool_call_id


@dataclass
class Message:
    """A whole output: ``content`` None when there is none (a reply made only of calls)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[FinishedCall] = field(default_factory=list)


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputParser:
    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolParser | None = None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel_tool_calls
        self._reasoning_stream = ReasoningStream(reasoning) if reasoning else None
        self._tool_stream = ToolCallStream(tools, parallel_tool_calls) if tools else None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def parse(self, text: str) -> Message:
        reasoning = None
        if self.reasoning is not None:
            split = self.reasoning.split(text, final=True)
            reasoning, text = split.reasoning or None, split.content
        if self.tools is None:
            return Message(content=text if text or reasoning is None else None, reasoning=reasoning)
        parsed = self.tools.parse(text, final=True)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        return Message(
            content=parsed.content or None if calls else text or None,
            reasoning=reasoning,
            tool_calls=[
                FinishedCall(tool_call_id(), call.name or "", call.arguments) for call in calls
            ],
        )

    def feed(self, text: str) -> Delta:
        return self._step(text, final=False)

    def finish(self) -> Delta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> Delta:
        delta = Delta()
        if self._reasoning_stream is not None:
            stream = self._reasoning_stream
            delta.reasoning, text = stream.finish() if final else stream.feed(text)
            if final and text:
                # The last content came with the finish: feed it before finishing the tools.
                text = self._feed_tools(delta, text)
        if self._tool_stream is None:
            delta.content += text
            return delta
        if not final:
            self._feed_tools(delta, text)
            return delta
        end = self._tool_stream.finish()
        delta.content += end.content
        delta.tool_calls += end.tool_calls
        return delta

    def _feed_tools(self, delta: Delta, text: str) -> str:
        if self._tool_stream is None:
            return text
        step = self._tool_stream.feed(text)
        delta.content += step.content
        delta.tool_calls += step.tool_calls
        return ""

    @property
    def streamed_calls(self) -> list[FinishedCall]:
        return self._tool_stream.calls if self._tool_stream is not None else []


def output_parser(engine: Any, plan: ToolPlan | None, prompt: str | None) -> OutputParser:
    """A choice's parser: the engine's reasoning parser (``--reasoning-parser``, which the
    prompt tells whether the output starts inside the reasoning), and the plan's tool parser."""
    name = engine.config.structured_outputs.reasoning_parser
    reasoning = REASONING_PARSERS[name](prompt) if name else None
    tools = plan.parser() if plan is not None else None
    parallel = plan.parallel_tool_calls if plan is not None else True
    return OutputParser(reasoning, tools, parallel)
