"""Bodies the app refuses before anything reaches the engine: each answer names the fault (no
model is loaded; the app's lifespan, which starts the engine, is not entered)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvik.engine.args import EngineArgs
from kvik_server.app import create_app


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(EngineArgs(model="/no/such/model")))


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    "body, headers, message",
    [
        # FastAPI said "There was an error parsing the body".
        (b'{"prompt": "\xff\xfe"}', JSON, "not valid UTF-8"),
        # FastAPI leaves a body not sent as JSON unparsed: "Input should be a valid dictionary".
        (b'{"prompt": "hi"}', {}, "without a Content-Type"),
        (b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, "as 'text/plain'"),
        # curl -d sends form data unless told otherwise.
        (b'{"prompt": "hi"}', {"Content-Type": "application/x-www-form-urlencoded"}, "as 'appl"),
        (b"", JSON, "the request body is empty"),
        (b"[1, 2]", JSON, "must be a JSON object, got an array"),
        (b"null", JSON, "must be a JSON object, got null"),
        (b'"hi"', JSON, "must be a JSON object, got a string"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_bodies_that_are_not_json_objects_get_400s_naming_why(client, path, body, headers, message):
    response = client.post(path, content=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "BadRequestError"


def test_a_field_of_the_body_still_names_its_field(client):
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": "5"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    # A check of the whole body keeps its own message.
    response = client.post("/v1/responses", json={"input": []})
    assert response.status_code == 400
    assert "input must not be empty" in response.json()["error"]["message"]
