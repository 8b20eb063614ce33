"""Responses' items: the input items as chat messages, and a reply as output items."""

from __future__ import annotations

import uuid
from typing import Any

from kvik.sampling_params import StructuredOutputsParams
from kvik_server.errors import APIError
from kvik_server.output_parsing import Message
from kvik_server.structured_outputs import check_schema

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages. Consecutive function calls become one assistant
    message's tool calls; a function call's output a tool message; reasoning items are dropped
    (chat templates drop past reasoning too)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise APIError(
                    f"{where}: a function_call_output needs a string call_id and output",
                    param=where,
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(
                f"{where}.type {kind!r} is not supported (message, function_call, "
                "function_call_output and reasoning are)",
                param=f"{where}.type",
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise APIError(
            f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}",
            param=f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise APIError(
                f"{where}.content[{j}]: only text parts ({', '.join(_TEXT_PARTS[:2])}) are "
                "supported",
                param=f"{where}.content",
            )
        if not isinstance(part.get("text"), str):
            raise APIError(f"{where}.content[{j}].text must be a string", param=where)
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not all(isinstance(v, str) for v in (name, arguments, call_id)):
        raise APIError(
            f"{where}: a function_call needs string name, arguments and call_id", param=where
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def text_format(
    text: dict[str, Any] | None,
) -> tuple[dict[str, Any], StructuredOutputsParams | None]:
    """``text.format`` (returned as given, default ``{"type": "text"}``) and the constraint it
    asks for."""
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict):
        raise APIError("text must be an object", param="text")
    fmt = text.get("format", {"type": "text"})
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError("text.format.schema must be a JSON schema object", param="text.format")
        if not isinstance(fmt.get("name"), str):
            raise APIError("text.format.name must be a string", param="text.format.name")
        return fmt, check_schema(schema, "text.format.schema", "text.format")
    raise APIError(
        f"text.format.type must be text, json_object or json_schema, got {kind!r}",
        param="text.format",
    )


def reasoning_item(text: str, status: str = "completed", id_: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {
        "id": id_ or item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": status,
    }


def message_item(text: str, status: str = "completed", id_: str | None = None) -> dict[str, Any]:
    content = [output_text(text)] if status == "completed" else []
    return {
        "id": id_ or item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", id_: str | None = None
) -> dict[str, Any]:
    return {
        "id": id_ or item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: Message) -> list[dict[str, Any]]:
    items = []
    if message.reasoning:
        items.append(reasoning_item(message.reasoning))
    if message.content:
        items.append(message_item(message.content))
    for call in message.tool_calls:
        items.append(function_call_item(call.id, call.name, call.arguments))
    if not items:
        items.append(message_item(""))
    return items


def items_as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up continues from."""
    content = "".join(
        part["text"]
        for item in items
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return [message]
