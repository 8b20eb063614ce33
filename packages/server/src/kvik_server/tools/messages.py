"""Chat messages as chat templates expect them: an assistant's tool calls with their arguments
as objects (OpenAI sends them as JSON text; templates such as Qwen's and Llama's write them with
``tojson``), and tool results beside the call they answer."""

from __future__ import annotations

import json
from typing import Any

from kvik_server.errors import APIError


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    result = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise APIError(f"messages[{i}].tool_call_id must be a string", param="messages")
        if calls is None:
            result.append(message)
            continue
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise APIError(
                f"messages[{i}].tool_calls must be a list, on an assistant message",
                param="messages",
            )
        result.append(
            {**message, "tool_calls": [_call(i, j, call) for j, call in enumerate(calls)]}
        )
    return result


def _call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(f"{where} must have a function with a name", param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise APIError(
                f"{where}.function.arguments is not JSON: {e}", param="messages"
            ) from None
    return {**call, "function": {**function, "arguments": arguments}}
