"""The curl command ``kvik serve`` logs once ready works as printed: the README's request without
API keys, and with ``--api-key`` the Authorization header a key needs (not the key itself)."""

from __future__ import annotations

import json
import shlex

from kvik_server.app import example_request


def headers_and_body(command: str) -> tuple[list[str], dict]:
    words = shlex.split(command)
    assert words[:2] == ["curl", "http://127.0.0.1:8000/v1/chat/completions"]
    headers = [words[i + 1] for i, word in enumerate(words) if word == "-H"]
    return headers, json.loads(words[words.index("-d") + 1])


def test_the_example_request_without_api_keys():
    headers, body = headers_and_body(example_request("http://127.0.0.1:8000", "m", []))
    assert headers == ["Content-Type: application/json"]
    assert body == {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France?"}]}  # fmt: skip


def test_the_example_request_with_an_api_key_carries_its_header_not_the_key():
    command = example_request("http://127.0.0.1:8000", "m", ["secret"])
    headers, body = headers_and_body(command)
    assert headers == ["Content-Type: application/json", "Authorization: Bearer <your API key>"]
    assert "secret" not in command and body["model"] == "m"
