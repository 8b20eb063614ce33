"""Tool calling and the Responses API through the official openai client against ``kvik serve``
(a random-weight model; one server for the module).

The tests marked ``needs_structured_outputs`` rely on the engine enforcing the grammar that
``tool_choice`` "required"/named and ``text.format`` json_schema ask for (xgrammar); a random
model writes JSON only under it.
"""

from __future__ import annotations

import importlib.util
import json

import httpx
import openai
import pytest
from server_process import ServerProcess
from tiny_models import build_tiny_model, save_tiny_tokenizer

needs_structured_outputs = pytest.mark.skipif(
    importlib.util.find_spec("kvik.structured_output") is None
    or importlib.util.find_spec("xgrammar") is None,
    reason="needs the engine's structured outputs (kvik.structured_output, with xgrammar)",
)

#: The tiny model's context is 512 tokens, ~400 of which a prompt with the tools in it takes: the
#: tests ask at most 100 more (a limit past the context is a 400).
ENGINE = ["--num-kv-blocks", "128", "--max-model-len", "512", "--seed", "0"]
SERVER = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
# The tiny tokenizer's template, plus the tools and the calls and results of past turns.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{{ m.content or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CITY = {"type": "string", "enum": ["Paris", "Oslo"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "today's weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_tokenizer(build_tiny_model("llama", tmp_path_factory.mktemp("tools")))
    template = folder / "tools_template.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess(folder, *ENGINE, *SERVER, "--chat-template", str(template))
    yield server.wait_ready()
    server.stop_and_check()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(client, stream: bool, **kwargs):
    """A chat completion, streamed or not, as (message dict, finish_reason); a stream's deltas
    are assembled the way the openai client's helpers do."""
    kwargs = {"model": client.models.list().data[0].id, "max_tokens": 48, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.model_dump(), choice.finish_reason
    message = {"content": None, "tool_calls": []}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                message["content"] = (message["content"] or "") + delta.content
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(message["tool_calls"])
                    message["tool_calls"].append(
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.function.name, "arguments": ""},
                        }
                    )
                message["tool_calls"][call.index]["function"]["arguments"] += (
                    call.function.arguments or ""
                )
            finish = choice.finish_reason or finish
    return message, finish


def test_template_receives_tools_and_past_calls(server):
    conversation = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    http = httpx.Client(base_url=server.url)
    tokens = http.post("/tokenize", json={"messages": conversation, "tools": [WEATHER]}).json()[
        "tokens"
    ]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tools>[{"type": "function", "function": {"name": "weather"' in text
    # The call's arguments reach the template as an object, not as JSON text.
    assert (
        '<assistant><tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
        in text
    )
    assert "<tool>sunny\n" in text and text.endswith("<assistant>")


def test_auto_with_plain_output_is_content(client):
    """A random model writes no <tool_call>: under "auto" its output is the answer, the same
    streamed and not."""
    kwargs = dict(messages=ASK, tools=[WEATHER, TIME], temperature=0)
    whole, finish = chat(client, False, **kwargs)
    streamed, streamed_finish = chat(client, True, **kwargs)
    assert whole["tool_calls"] in (None, []) and streamed["tool_calls"] == []
    assert whole["content"] and streamed["content"] == whole["content"]
    assert finish == streamed_finish and finish in ("stop", "length")


@needs_structured_outputs
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_call_round_trip(client, stream, choice):
    tool_choice = (
        {"type": "function", "function": {"name": "weather"}} if choice == "named" else "required"
    )
    kwargs = dict(tools=[WEATHER], temperature=0.8, seed=1, max_tokens=100)
    # One call: "required" may make several unless parallel_tool_calls is false (maxItems 1).
    one = dict(parallel_tool_calls=False) if choice == "required" else {}
    message, finish = chat(client, stream, messages=ASK, tool_choice=tool_choice, **kwargs, **one)
    assert finish == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"])["city"] in CITY["enum"]
    result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}, result]
    answer, finish = chat(client, stream, messages=history, tool_choice="none", **kwargs)
    assert isinstance(answer["content"], str) and not answer["tool_calls"]
    assert finish in ("stop", "length")


def test_tool_errors_are_400s(server, client):
    model = client.models.list().data[0].id
    bad = [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "retrieval"}]}, "'function'"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [WEATHER, WEATHER]}, "more than one"),
    ]
    for extra, message in bad:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **extra)
    broken_call = ASK + [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        client.chat.completions.create(model=model, messages=broken_call, max_tokens=4)
    # The server still serves.
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2).choices


RESPONSE_TOOL = {
    "type": "function",
    "name": "weather",
    "parameters": WEATHER["function"]["parameters"],
}


def stream_response(client, **kwargs):
    events = list(client.responses.create(**kwargs, stream=True))
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events, events[-1].response


def test_responses_text_store_and_follow_up(client):
    model = client.models.list().data[0].id
    kwargs = dict(
        model=model, input="Hello", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    response = client.responses.create(**kwargs)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0
    assert client.responses.retrieve(response.id).output_text == response.output_text
    events, streamed = stream_response(client, **kwargs)
    types = [event.type for event in events]
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kind in types
    assert streamed.output_text == response.output_text
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == response.output_text
    )
    follow = client.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "More?"}]}],
        previous_response_id=response.id,
        max_output_tokens=4,
    )
    assert (
        follow.previous_response_id == response.id
        and follow.usage.input_tokens > response.usage.input_tokens
    )
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(**kwargs | {"store": False})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@needs_structured_outputs
@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_tool_round_trip(client, stream):
    model = client.models.list().data[0].id
    kwargs = dict(
        model=model,
        input="Weather in Paris?",
        tools=[RESPONSE_TOOL],
        tool_choice={"type": "function", "name": "weather"},
        temperature=0.8,
        max_output_tokens=100,
    )
    if stream:
        events, response = stream_response(client, **kwargs)
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert deltas == done.arguments
    else:
        response = client.responses.create(**kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments)["city"] in CITY["enum"]
    answer = client.responses.create(
        model=model,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[RESPONSE_TOOL],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]


@needs_structured_outputs
@pytest.mark.parametrize("stream", [False, True])
def test_responses_json_schema(client, stream):
    schema = {
        "type": "object",
        "properties": {"city": CITY},
        "required": ["city"],
        "additionalProperties": False,
    }
    kwargs = dict(
        model=client.models.list().data[0].id,
        input="Pick a city.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        temperature=0.8,
        max_output_tokens=100,
    )
    response = stream_response(client, **kwargs)[1] if stream else client.responses.create(**kwargs)
    assert response.status == "completed"
    assert json.loads(response.output_text)["city"] in CITY["enum"]


def test_responses_errors_are_400s(server, client):
    model = client.models.list().data[0].id
    bad = [
        ({"input": [{"type": "image", "url": "x"}]}, "not supported"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "role must be"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, "not stored"),
        (
            {
                "input": "hi",
                "tools": [RESPONSE_TOOL],
                "tool_choice": {"type": "function", "name": "nope"},
            },
            "not in tools",
        ),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [], "model": model}, "input must not be empty"),
        # Logprobs were ignored: the reply came without them.
        ({"input": "hi", "top_logprobs": 2}, "logprobs are not supported"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "logprobs are not"),
    ]
    for extra, message in bad:
        with pytest.raises(openai.BadRequestError, match=message):
            client.responses.create(**{"model": model, **extra})
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_missing")
