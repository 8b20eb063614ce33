"""The Responses API's streamed events, in the order the openai client expects: each output item
is added, its content streams (``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``), then it is done, before the next item begins."""

from __future__ import annotations

import json
from typing import Any

from kvik_server.output_parsing import Delta
from kvik_server.responses.items import (
    function_call_item,
    item_id,
    message_item,
    output_text,
    reasoning_item,
)


class _OpenItem:
    def __init__(self, kind: str, index: int, item: dict[str, Any]) -> None:
        self.kind = kind  # reasoning, message or function_call
        self.index = index
        self.item = item
        self.text = ""


class ResponseEvents:
    def __init__(self) -> None:
        self.sequence_number = 0
        #: Finished output items, in order.
        self.items: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None
        #: The open function call item of each tool-call index.
        self.calls: dict[int, _OpenItem] = {}

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def step(self, delta: Delta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._tool_call(call)
        return events

    def close_all(self) -> list[str]:
        """Finish the open item; an output with nothing in it is one empty message, as the
        unstreamed response has."""
        events = self._close()
        if not self.items:
            events += self._start("message", message_item("", "in_progress", item_id("msg")))
            events += self._close()
        return events

    def _start(self, kind: str, item: dict[str, Any]) -> list[str]:
        events = self._close()
        self.open = _OpenItem(kind, len(self.items), item)
        events.append(
            self.event("response.output_item.added", output_index=self.open.index, item=item)
        )
        part = _part(kind, "")
        if part is not None:
            events.append(self._part_event("response.content_part.added", part))
        return events

    def _part_event(self, kind: str, part: dict[str, Any]) -> str:
        assert self.open is not None
        return self.event(
            kind,
            item_id=self.open.item["id"],
            output_index=self.open.index,
            content_index=0,
            part=part,
        )

    def _text(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open.kind != kind:
            item = (
                reasoning_item("", "in_progress", item_id("rs"))
                if kind == "reasoning"
                else message_item("", "in_progress", item_id("msg"))
            )
            events += self._start(kind, item)
        assert self.open is not None
        self.open.text += text
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(
            self.event(
                name,
                item_id=self.open.item["id"],
                output_index=self.open.index,
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        index = call["index"]
        function = call.get("function", {})
        if "id" in call:
            item = function_call_item(call["id"], function["name"], "", "in_progress")
            events += self._start("function_call", item)
            assert self.open is not None
            self.calls[index] = self.open
        arguments = function.get("arguments", "")
        if arguments:
            open_call = self.calls[index]
            open_call.text += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=open_call.item["id"],
                    output_index=open_call.index,
                    delta=arguments,
                )
            )
        return events

    def _close(self) -> list[str]:
        """Finish the open item: its done events, then it joins the output."""
        current, self.open = self.open, None
        if current is None:
            return []
        events: list[str] = []
        ids = {"item_id": current.item["id"], "output_index": current.index}
        if current.kind == "function_call":
            current.item = {**current.item, "arguments": current.text, "status": "completed"}
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=current.item["name"],
                    arguments=current.text,
                )
            )
        else:
            done = (
                "response.reasoning_text.done"
                if current.kind == "reasoning"
                else "response.output_text.done"
            )
            extra: dict[str, Any] = {} if current.kind == "reasoning" else {"logprobs": []}
            events.append(self.event(done, **ids, content_index=0, text=current.text, **extra))
            self.open = current
            events.append(
                self._part_event("response.content_part.done", _part(current.kind, current.text))
            )
            self.open = None
            current.item = (
                reasoning_item(current.text, "completed", current.item["id"])
                if current.kind == "reasoning"
                else message_item(current.text, "completed", current.item["id"])
            )
        events.append(
            self.event("response.output_item.done", output_index=current.index, item=current.item)
        )
        self.items.append(current.item)
        return events


def _part(kind: str, text: str) -> dict[str, Any] | None:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    if kind == "message":
        return output_text(text)
    return None
