"""The server with speculative decoding, through the openai client: streamed chat with logprobs
(several tokens a step, each with its logprobs), a JSON-schema reply and a penalised completion,
each equal to the offline engine without speculation."""

from __future__ import annotations

import json

import openai
import pytest
from server_process import ServerProcess
from tiny_models import save_tiny_tokenizer

from kvik import LLM, SamplingParams
from kvik.sampling_params import StructuredOutputsParams

MESSAGES = [{"role": "user", "content": "Name a colour and a number."}]
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["colour", "n"],
}


@pytest.fixture(scope="module")
def model(tiny_model):
    folder = tiny_model("llama")
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def server(model):
    # The target as its own draft: its greedy drafts are accepted wherever no mask or penalty
    # changes the choice, so steps hand out several tokens.
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    server = ServerProcess(
        model, "--dtype", "float32", "--speculative-config", json.dumps(config)
    ).wait_ready()
    yield server
    server.stop_and_check()


@pytest.fixture(scope="module")
def offline(model):
    return LLM(str(model), dtype="float32")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_streamed_chat_with_logprobs(client, offline, model):
    (expected,) = offline.chat(
        MESSAGES, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2), use_tqdm=False
    )
    text, tokens, chunks = "", [], 0
    for chunk in client.chat.completions.create(
        model=str(model),
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    ):
        for choice in chunk.choices:
            chunks += 1
            text += choice.delta.content or ""
            tokens += choice.logprobs.content if choice.logprobs else []
    assert text == expected.outputs[0].text
    want = [next(iter(d.values())).logprob for d in expected.outputs[0].logprobs]
    assert [t.logprob for t in tokens] == pytest.approx(want, abs=1e-4)
    assert all(len(t.top_logprobs) == 2 for t in tokens)
    # Accepted drafts come several to a step: fewer chunks than tokens.
    assert chunks < len(expected.outputs[0].token_ids)


def test_json_schema_reply(client, offline, model):
    params = SamplingParams(
        temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    (expected,) = offline.chat(MESSAGES, params, use_tqdm=False)
    reply = client.chat.completions.create(
        model=str(model),
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
    )
    content = reply.choices[0].message.content
    assert content == expected.outputs[0].text
    if reply.choices[0].finish_reason == "stop":
        assert set(json.loads(content)) == {"colour", "n"}


def test_penalised_completion(client, offline, model, server):
    prompt = "abcabcabc"
    expected = offline.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=20, frequency_penalty=0.5, presence_penalty=0.4),
        use_tqdm=False,
    )[0]
    got = client.completions.create(
        model=str(model),
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        frequency_penalty=0.5,
        presence_penalty=0.4,
    )
    assert got.choices[0].text == expected.outputs[0].text
    metrics = server.metrics()
    assert metrics["kvik:spec_decode_num_drafts_total"] > 0
    assert metrics["kvik:spec_decode_num_accepted_tokens_total"] > 0
