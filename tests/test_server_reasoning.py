"""``--reasoning-parser`` through the openai client against ``kvik serve``: a chat template that
opens ``<think>`` puts a random model's whole output in its reasoning (it never writes
``</think>``), which chat returns as ``reasoning_content`` and responses as a reasoning item,
streamed and not. The raw text is the same request through /v1/completions."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_process import ServerProcess
from tiny_models import TINY_CHAT_TEMPLATE, build_tiny_model, save_tiny_tokenizer

ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "256"]
THINKING_TEMPLATE = TINY_CHAT_TEMPLATE.replace("<assistant>", "<assistant><think>")
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_tokenizer(build_tiny_model("llama", tmp_path_factory.mktemp("reasoning")))
    template = folder / "thinking_template.jinja"
    template.write_text(THINKING_TEMPLATE)
    server = ServerProcess(
        folder,
        *ENGINE,
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        str(template),
        "--trust-request-chat-template",
    )
    yield server.wait_ready()
    server.stop_and_check()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def raw_text(server, client):
    """What the model writes after the thinking prompt, unparsed."""
    http = httpx.Client(base_url=server.url)
    tokens = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"].endswith("<think>")
    model = client.models.list().data[0].id
    text = client.completions.create(
        model=model, prompt=tokens, max_tokens=MAX_TOKENS, temperature=0
    )
    text = text.choices[0].text
    assert text and "</think>" not in text
    return text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_content(client, raw_text, stream):
    kwargs = dict(
        model=client.models.list().data[0].id, messages=ASK, max_tokens=MAX_TOKENS, temperature=0
    )
    if stream:
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
        assert reasoning == raw_text and content == ""
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.reasoning_content == raw_text and message.content is None


def test_chat_without_thinking_is_content(client, raw_text):
    """qwen3 reasons only where the output (or the prompt) opens <think>."""
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=ASK,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"chat_template": TINY_CHAT_TEMPLATE},
    )
    message = response.choices[0].message
    assert message.content and message.reasoning_content is None


@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_item(client, raw_text, stream):
    kwargs = dict(
        model=client.models.list().data[0].id,
        input=ASK[0]["content"],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == raw_text
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    (item,) = response.output
    assert item.type == "reasoning" and item.content[0].text == raw_text
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= MAX_TOKENS
