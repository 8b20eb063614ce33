"""Reading JSON that is still being generated: where a value ends, and what an unfinished object
holds so far. The tool parsers stream a call's arguments as the model writes them, so they must
know, at any prefix of the text, which characters are the arguments and whether they are done."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\n\r"


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that starts at ``start``, or None while the text ends
    before the value does. Only the value's extent is found here; ``json.loads`` judges it."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        depth, pos = 0, start
        while pos < len(text):
            char = text[pos]
            if char == '"':
                end = _string_end(text, pos)
                if end is None:
                    return None
                pos = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return pos + 1
            pos += 1
        return None
    # A number, true, false or null: it ends at the first character that cannot continue it,
    # so at the end of the text it may still be growing.
    pos = start
    while pos < len(text) and text[pos] not in _WHITESPACE + ",}]":
        pos += 1
    return pos if pos < len(text) else None


def _string_end(text: str, start: int) -> int | None:
    pos = start + 1
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == '"':
            return pos + 1
        pos += 1
    return None


@dataclass
class PartialObject:
    """What a JSON object's text holds so far: its finished members (parsed), the raw text of the
    member being written (``open_key``, ``open_raw``), and whether the object is closed (``end``:
    the index past its ``}``)."""

    members: dict[str, object] = field(default_factory=dict)
    raw: dict[str, str] = field(default_factory=dict)
    open_key: str | None = None
    open_raw: str = ""
    end: int | None = None
    #: The text is not a JSON object (or not one with string keys): stop reading it as a call.
    invalid: bool = False


def read_partial_object(text: str, start: int) -> PartialObject:
    """Read the object that starts at ``text[start]`` (a ``{``) as far as the text goes."""
    result = PartialObject()
    if start >= len(text) or text[start] != "{":
        result.invalid = start < len(text)
        return result
    pos = skip_whitespace(text, start + 1)
    if pos < len(text) and text[pos] == "}":
        result.end = pos + 1
        return result
    while pos < len(text):
        if text[pos] != '"':
            result.invalid = True
            return result
        key_end = _string_end(text, pos)
        if key_end is None:
            return result
        key = json.loads(text[pos:key_end])
        pos = skip_whitespace(text, key_end)
        if pos >= len(text):
            return result
        if text[pos] != ":":
            result.invalid = True
            return result
        pos = skip_whitespace(text, pos + 1)
        if pos >= len(text):
            result.open_key = key
            return result
        end = value_end(text, pos)
        if end is None:
            result.open_key, result.open_raw = key, text[pos:]
            return result
        raw = text[pos:end]
        try:
            result.members[key] = json.loads(raw)
        except json.JSONDecodeError:
            result.invalid = True
            return result
        result.raw[key] = raw
        pos = skip_whitespace(text, end)
        if pos >= len(text):
            return result
        if text[pos] == "}":
            result.end = pos + 1
            return result
        if text[pos] != ",":
            result.invalid = True
            return result
        pos = skip_whitespace(text, pos + 1)
    return result
