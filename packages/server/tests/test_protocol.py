"""The request models reject what OpenAI's API rejects, before anything reaches the engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvik_server.errors import error_body
from kvik_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


@pytest.mark.parametrize(
    "prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]], ids=["str", "strs", "ids", "id-lists"]
)
def test_completion_prompts_of_every_openai_shape(prompt):
    assert CompletionRequest(prompt=prompt).prompt == prompt


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": "0.5"},  # strict types: a string is not a number
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0.0},
        {"n": 0},
        {"max_tokens": 0},
        {"presence_penalty": 3.0},
        {"logprobs": 21},
        {"prompt_logprobs": -2},
        {"repetition_penalty": 0.0},
        {"stop_token_ids": [1, True]},  # a bool is not a token id
        {"stream_options": {"include_usage": True}},  # only with stream
        {"prompt": [[1, "x"]]},
        # The engine's messages carry 64-bit ints: bigger ones are refused here (were 500s).
        {"max_tokens": 2**63},
        {"top_k": 2**70},
        {"min_tokens": 2**64},
        {"seed": -(2**63) - 1},
        {"priority": 2**63},
        {"best_of": 0},
    ],
)
def test_completion_request_rejects(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**{"prompt": "hi", **fields})


def test_chat_request_needs_messages_and_unknown_fields_are_ignored():
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        some_future_field=1,
    )
    assert request.stream_options.include_usage
    assert not hasattr(request, "some_future_field")


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens", "top_k"])
def test_chat_request_rejects_ints_past_int64(field):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{field: 2**70})


def test_responses_request_rejects_ints_past_int64():
    from kvik_server.responses.protocol import ResponsesRequest

    for field in ("max_output_tokens", "top_k", "seed", "priority"):
        with pytest.raises(ValidationError):
            ResponsesRequest(input="hi", **{field: 2**70})


def test_tokenize_takes_exactly_one_input():
    assert TokenizeRequest(prompt="hi").prompt == "hi"
    with pytest.raises(ValidationError):
        TokenizeRequest()
    with pytest.raises(ValidationError):
        TokenizeRequest(prompt="hi", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValidationError):
        DetokenizeRequest(tokens=["1"])


def test_error_bodies_have_openais_shape():
    body = error_body("temperature must be >= 0", 400, param="temperature")
    assert body == {
        "error": {
            "message": "temperature must be >= 0",
            "type": "BadRequestError",
            "param": "temperature",
            "code": 400,
        }
    }
    assert error_body("no key", 401)["error"]["type"] == "AuthenticationError"


def test_priority_needs_the_priority_policy():
    from types import SimpleNamespace

    from kvik_server.errors import APIError
    from kvik_server.serving import check_priority

    def engine(policy):
        return SimpleNamespace(config=SimpleNamespace(scheduler=SimpleNamespace(policy=policy)))

    check_priority(engine("fcfs"), 0)
    check_priority(engine("priority"), -5)
    with pytest.raises(APIError, match="--scheduling-policy priority") as error:
        check_priority(engine("fcfs"), 3)
    assert error.value.param == "priority"


def test_completions_honour_add_special_tokens():
    """add_special_tokens=false tokenizes text prompts without the BOS (it was ignored)."""
    from types import SimpleNamespace

    from kvik_server.serving import Completions

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    completions = Completions(SimpleNamespace(tokenizer=Tokenizer()), "m")
    plain = CompletionRequest(prompt=["ab", "c"])
    assert completions._prompts(plain) == ["ab", "c"]  # the engine tokenizes, BOS and all
    bare = CompletionRequest(prompt=["ab", "c"], add_special_tokens=False)
    assert completions._prompts(bare) == [
        {"prompt": "ab", "prompt_token_ids": [97, 98]},
        {"prompt": "c", "prompt_token_ids": [99]},
    ]
    ids = CompletionRequest(prompt=[5, 6], add_special_tokens=False)
    assert completions._prompts(ids) == [[5, 6]]


@pytest.mark.parametrize(
    "message, param",
    [
        ("logit_bias must hold token ids in [0, 256), got [999]", "logit_bias"),
        ("prompt_logprobs=-1 asks for 256 logprobs a position", "prompt_logprobs"),
        ("invalid structured_outputs.regex: not a regex", "structured_outputs"),
        ("message 2 has role 'robot'", "messages.2"),
        ("the given chat_template failed: TemplateSyntaxError", "chat_template"),
        ("the prompt has 300 tokens but max_model_len is 256", None),
        ("text must be valid Unicode", None),
    ],
)
def test_engine_errors_name_their_field(message, param):
    from kvik_server.app import _value_error_param

    assert _value_error_param(message) == param


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": float("nan")},  # was "Input should be less than or equal to 2"
        {"top_p": float("nan")},
        {"min_p": float("nan")},
        {"presence_penalty": float("-inf")},
        {"repetition_penalty": float("nan")},
        {"repetition_penalty": float("inf")},
        {"logit_bias": {"5": float("nan")}},
    ],
)
def test_nan_and_infinities_are_refused_as_such(fields):
    with pytest.raises(ValidationError, match="finite number"):
        CompletionRequest(**{"prompt": "hi", **fields})


def test_an_engine_request_error_names_the_field_at_fault():
    """A request the engine ended for its own fault (its constraint admits no token) is a 400
    naming the field its constraint came from, or the field the engine blames."""
    from kvik.outputs import RequestError
    from kvik_server.serving import constraint_param, request_error
    from kvik_server.tools.choice import ToolPlan

    messages = [{"role": "user", "content": "hi"}]
    plain = ChatCompletionRequest(messages=messages, structured_outputs={"regex": "a"})
    json_format = ChatCompletionRequest(messages=messages, response_format={"type": "json_object"})
    text_format = CompletionRequest(prompt="hi", response_format={"type": "text"})
    assert constraint_param(plain) == "structured_outputs"
    assert constraint_param(json_format) == "response_format"
    assert constraint_param(text_format) == "structured_outputs"
    for mode, param in (("required", "tool_choice"), ("named", "tool_choice"), ("auto", None)):
        expected = param or "response_format"
        assert constraint_param(json_format, ToolPlan([], mode)) == expected
    error = request_error(RequestError("nothing left", "structured_outputs"), "response_format")
    assert (error.status, error.param, error.message) == (400, "response_format", "nothing left")
    error = request_error(RequestError("nothing left", "allowed_token_ids"), "response_format")
    assert error.param == "allowed_token_ids"
