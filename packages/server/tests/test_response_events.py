"""The Responses API's streamed events for one output: items in order, each added, streamed and
done before the next; the finished items equal what the stream said."""

from __future__ import annotations

import json

from kvik_server.output_parsing import Delta
from kvik_server.responses.events import ResponseEvents
from kvik_server.responses.store import ResponseStore, StoredResponse


def decode(events: list[str]) -> list[dict]:
    payloads = []
    for event in events:
        kind_line, data_line = event.strip().split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {payload['type']}"
        payloads.append(payload)
    return payloads


def test_reasoning_then_text_then_calls():
    emit = ResponseEvents()
    steps = [
        Delta(reasoning="Think"),
        Delta(reasoning="ing.", content="Hi"),
        Delta(content="!"),
        Delta(
            tool_calls=[{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": ""}}]
        ),
        Delta(tool_calls=[{"index": 0, "function": {"arguments": '{"x": '}}]),
        Delta(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
    ]
    events = [e for step in steps for e in emit.step(step)] + emit.close_all()
    payloads = decode(events)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    done = [p for p in payloads if p["type"] == "response.output_item.done"]
    assert [p["output_index"] for p in done] == [0, 1, 2]
    assert [p["item"] for p in done] == emit.items
    reasoning, message, call = emit.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Hi!" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_a", "f", '{"x": 1}')


def test_empty_output_is_one_empty_message():
    emit = ResponseEvents()
    payloads = decode(emit.close_all())
    assert payloads[-1]["type"] == "response.output_item.done"
    assert emit.items[0]["type"] == "message" and emit.items[0]["content"][0]["text"] == ""


def test_store_is_bounded_lru():
    store = ResponseStore(2)
    for name in "abc":
        if name == "c":
            assert store.get("a") is not None  # a is now the most recent
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    empty = ResponseStore(0)
    empty.put("x", StoredResponse({}, []))
    assert empty.get("x") is None


def test_a_stream_whose_engine_died_says_503():
    """The engine's death mid-stream is an error event with code 503, as the other routes' streams
    say (it was a 500)."""
    import asyncio

    from kvik.engine.async_llm import EngineDeadError
    from kvik_server.responses.protocol import ResponsesRequest
    from kvik_server.responses.serving import Responses, _Response
    from kvik_server.tools.choice import ToolPlan

    async def events():
        raise EngineDeadError("the engine core process died")
        yield

    async def run() -> list[str]:
        response = _Response(
            ResponsesRequest(input="hi"), "resp_1", {"type": "text"}, ToolPlan([], "none"), [], "m"
        )
        stream = Responses.__new__(Responses)._stream(response, events(), parser=None)
        return [event async for event in stream]

    error = decode(asyncio.run(run()))[-1]
    assert error["type"] == "error" and error["code"] == "503"
    assert "engine core" in error["message"]
