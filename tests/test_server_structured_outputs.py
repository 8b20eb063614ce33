"""Structured outputs through the official openai client against ``kvik serve`` with the default
model: JSON schemas (response_format), regex and choice (vLLM's structured_outputs field),
``chat.completions.parse`` with a Pydantic model, and bad constraints answered with a 400."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest
from server_process import ServerProcess
from structured_output_schemas import SCHEMAS

MODEL = "smollm2-135m-instruct"
GENERATIONS_PER_SCHEMA = 5


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(MODEL, "--max-model-len", "1024").wait_ready()
    yield server
    server.stop_and_check()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _requests_finished(server: ServerProcess) -> float:
    return server.metrics()["kvik:e2e_request_latency_seconds_count"]


def test_100_sampled_generations_follow_20_schemas(server):
    """Sampled (temperature 0.8, a seed each), all at once: every answer ends by itself ("stop")
    and validates, with one engine request per API request (nothing retried or repaired)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def one(schema: dict, seed: int) -> tuple[str, str]:
        response = await client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": f"Reply with JSON for this schema: {json.dumps(schema)}",
                }
            ],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
            temperature=0.8,
            seed=seed,
            max_tokens=160,
        )
        choice = response.choices[0]
        return choice.finish_reason, choice.message.content

    async def run() -> list[tuple[str, str]]:
        jobs = [
            one(schema, seed=100 * i + k)
            for i, schema in enumerate(SCHEMAS)
            for k in range(GENERATIONS_PER_SCHEMA)
        ]
        return await asyncio.gather(*jobs)

    before = _requests_finished(server)
    answers = asyncio.run(run())
    assert _requests_finished(server) - before == len(answers) == 100
    for index, (finish_reason, text) in enumerate(answers):
        assert finish_reason == "stop", (index, text)
        jsonschema.validate(json.loads(text), SCHEMAS[index // GENERATIONS_PER_SCHEMA])


def test_regex_and_choice(client):
    for seed in range(3):
        completion = client.completions.create(
            model=MODEL,
            prompt="My phone number is",
            max_tokens=20,
            temperature=0.8,
            seed=seed,
            extra_body={"structured_outputs": {"regex": r" ?\d{3}-\d{4}"}},
        )
        assert completion.choices[0].finish_reason == "stop"
        assert re.fullmatch(r" ?\d{3}-\d{4}", completion.choices[0].text)
    choices = ["Paris", "London", "Berlin"]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=10,
        temperature=0.8,
        seed=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert chat.choices[0].message.content in choices
    assert chat.choices[0].finish_reason == "stop"


def test_response_format_in_completions_and_json_object_in_chat(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    completion = client.completions.create(
        model=MODEL,
        prompt='Status as JSON: {"ok": true}\nStatus as JSON: {"ok": false}\nStatus as JSON:',
        max_tokens=40,
        temperature=0.0,
        # response_format is not an argument of the client's completions.create
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), schema)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Reply with a JSON object with the key ok set to true."}
        ],
        max_tokens=100,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=50)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0.0,
        max_tokens=100,
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(completion.choices[0].message.parsed, City)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
        ({"structured_outputs": {"json": {"type": "object", "minProperties": "x"}}}, "json"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"structured_outputs": {"pattern": "a"}}, "unknown keys"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ],
)
def test_bad_constraints_get_400_and_the_server_keeps_serving(client, extra, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_body=extra)
    assert message in str(error.value)
    answer = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert answer.choices[0].text
