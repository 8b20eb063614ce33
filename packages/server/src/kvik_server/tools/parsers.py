"""Tool-call parsers (``--tool-call-parser``): find the calls a model wrote in its output.

Each parser reads the whole output text so far and says which part of it is the answer (content)
and which calls it holds, each with its name and the raw text of its arguments as far as they go.
Reading the whole text each time (rather than keeping state per token) makes the streamed and the
final answers agree by construction: streaming sends what grew since the last read
(kvik_server.tools.stream). With ``final``, a call that does not parse makes the whole output
plain content, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvik_server.tools.json_scan import (
    read_partial_object,
    skip_whitespace,
    value_end,
)


@dataclass
class CallText:
    """One tool call as far as the text goes: ``arguments`` is the raw JSON text written so far
    (whole once ``complete``)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallText] = field(default_factory=list)


def _plain(text: str) -> Parsed:
    return Parsed(content=text)


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``: they are not
    sent as content until the next tokens say whether the marker follows."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


_ARGUMENT_KEYS = ("arguments", "parameters")


def read_call_object(text: str, start: int) -> tuple[CallText | None, int | None]:
    """The call ``{"name": ..., "arguments"|"parameters": {...}}`` at ``start``: (the call, the
    index past it once closed). (None, None) when the text there is not such an object."""
    obj = read_partial_object(text, start)
    if obj.invalid:
        return None, None
    name = obj.members.get("name")
    if name is not None and not isinstance(name, str):
        return None, None
    call = CallText(name=name)
    key = next((k for k in _ARGUMENT_KEYS if k in obj.members), None)
    if key is not None:
        value = obj.members[key]
        if isinstance(value, dict):
            call.arguments = obj.raw[key]
        elif isinstance(value, str) and _is_json_object(value):
            # Some models write the arguments as a JSON string holding the object.
            call.arguments = value
        else:
            return None, None
    elif obj.open_key in _ARGUMENT_KEYS:
        if obj.open_raw and obj.open_raw[0] == "{":
            call.arguments = obj.open_raw
        elif obj.open_raw:
            # A string of JSON is only usable once whole; nothing streams until then.
            if obj.open_raw[0] != '"':
                return None, None
    if obj.end is not None:
        if call.name is None or key is None:
            return None, None
        call.complete = True
    return call, obj.end


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def read_call_array(text: str, start: int) -> tuple[list[CallText] | None, int | None]:
    """A JSON array of call objects at ``start``: (the calls so far, the index past ``]``)."""
    calls: list[CallText] = []
    pos = skip_whitespace(text, start)
    if pos >= len(text):
        return calls, None
    if text[pos] != "[":
        return None, None
    pos = skip_whitespace(text, pos + 1)
    if pos < len(text) and text[pos] == "]":
        return calls, pos + 1
    while pos < len(text):
        call, end = read_call_object(text, pos)
        if call is None:
            return None, None
        calls.append(call)
        if end is None:
            return calls, None
        pos = skip_whitespace(text, end)
        if pos >= len(text):
            return calls, None
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != ",":
            return None, None
        pos = skip_whitespace(text, pos + 1)
    return calls, None


def _finished(parsed: Parsed, text: str, final: bool) -> Parsed:
    """With ``final``, calls that are not all whole and named make the output plain text."""
    if final and (not parsed.calls or not all(c.complete for c in parsed.calls)):
        return _plain(text)
    return parsed


class ToolParser:
    """Finds tool calls in a model's output. ``keeps_special_tokens``: the markers are special
    tokens, so the output must be detokenized with them."""

    name = ""
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes,
    Qwen2.5, Qwen3). The content is what comes before the first block."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.OPEN)
        if first < 0:
            if final:
                return _plain(text)
            return Parsed(content=text[: len(text) - _held_back(text, self.OPEN)])
        parsed = Parsed(content=text[:first])
        pos = first
        while pos >= 0:
            body = skip_whitespace(text, pos + len(self.OPEN))
            close = text.find(self.CLOSE, body)
            block = text[: close if close >= 0 else len(text)]
            call, end = read_call_object(block, body)
            if call is None:
                return _plain(text) if final else parsed
            parsed.calls.append(call)
            if end is None or close < 0:
                break
            pos = text.find(self.OPEN, close + len(self.CLOSE))
        return _finished(parsed, text, final)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+'s JSON calls: the output is ``{"name": ..., "parameters": {...}}`` (after an
    optional ``<|python_tag|>``), several separated by ``;``. Output that does not start with
    ``{`` is an answer."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_whitespace(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = skip_whitespace(text, pos + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[pos:]):
            return Parsed()
        if pos >= len(text):
            return _plain(text) if final else Parsed()
        if text[pos] != "{":
            return _plain(text)
        parsed = Parsed()
        while pos < len(text):
            call, end = read_call_object(text, pos)
            if call is None:
                return _plain(text) if final else parsed
            parsed.calls.append(call)
            if end is None:
                break
            pos = skip_whitespace(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_whitespace(text, pos + 1)
            elif pos < len(text):
                return _plain(text) if final else parsed
        return _finished(parsed, text, final)


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral's tokenizers before
    v11); the content is what comes before the marker, a special token."""

    name = "mistral"
    keeps_special_tokens = True
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.MARKER)
        if start < 0:
            if final:
                return _plain(text)
            return Parsed(content=text[: len(text) - _held_back(text, self.MARKER)])
        calls, end = read_call_array(text, start + len(self.MARKER))
        if calls is None or (final and end is None):
            return _plain(text) if final else Parsed(content=text[:start])
        return _finished(Parsed(content=text[:start], calls=calls), text, final)


class RequiredToolsParser(ToolParser):
    """The output of ``tool_choice="required"``: the grammar makes it a JSON array of
    ``{"name", "parameters"}`` (vLLM's form)."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        calls, end = read_call_array(text, 0)
        if calls is None or (final and end is None):
            return _plain(text) if final else Parsed()
        return _finished(Parsed(calls=calls), text, final)


class NamedToolParser(ToolParser):
    """The output of ``tool_choice`` naming a function: the grammar makes it the arguments
    object alone."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_whitespace(text, 0)
        if start >= len(text):
            return _plain(text) if final else Parsed()
        if text[start] != "{":
            return _plain(text)
        end = value_end(text, start)
        arguments = text[start:end] if end is not None else text[start:]
        complete = end is not None and _is_json_object(arguments)
        if final and (not complete or text[end:].strip()):
            return _plain(text)
        return Parsed(calls=[CallText(self.function, arguments, complete)])


#: ``--tool-call-parser`` names.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
