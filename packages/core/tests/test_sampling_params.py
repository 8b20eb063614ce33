from __future__ import annotations

import pytest

from kvik.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.max_tokens, sp.min_tokens, sp.stop, sp.stop_token_ids) == (16, 0, [], [])
    assert sp.repetition_penalty == 1.0 and sp.skip_special_tokens and not sp.ignore_eos
    assert sp.seed is None and not sp.is_greedy


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []  # type: ignore[arg-type]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_below_vllms_temperature_threshold() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.7, seed=3).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be"),
        ({"n": True}, "n must be"),
        ({"n": 1.0}, "n must be"),
        ({"temperature": -1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be"),
        ({"top_k": 2.5}, "top_k must be"),
        ({"min_p": -0.1}, "min_p must be in"),
        ({"min_p": 1.1}, "min_p must be in"),
        ({"seed": "x"}, "seed must be"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"max_tokens": False}, "max_tokens must be"),
        ({"min_tokens": -1}, "min_tokens must be"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0"),
        ({"logprobs": -2}, "logprobs must be"),
        ({"logprobs": 1.5}, "logprobs must be"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be"),
        ({"logit_bias": {1: 101.0}}, "logit_bias values"),
        ({"logit_bias": {"1": 1.0}}, "logit_bias keys"),
        ({"logit_bias": [1]}, "logit_bias must be a dict"),
        ({"stop": 3}, "stop must be"),
        ({"stop": ["a", 3]}, "stop must be"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids must be"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"seed": 2**63}, r"seed must be an int in \[-2\*\*63, 2\*\*63\)"),
        ({"seed": -(2**63) - 1}, "seed must be an int in"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids must be"),
        ({"bad_words": "word"}, "bad_words must be"),
        ({"bad_words": ["x", ""]}, "bad_words must not hold an empty string"),
        ({"stop": ""}, "stop must not hold an empty string"),
        ({"stop": ["###", ""]}, "stop must not hold an empty string"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs must be a StructuredOut"),
        ({"structured_outputs": "{}"}, "structured_outputs must be a StructuredOutputsParams"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be"),
    ],
)
def test_invalid(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0, "min_p": 1.0},
        {"top_k": -1},
        {"max_tokens": None, "min_tokens": 100},
        {"min_tokens": 4, "max_tokens": 4},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": -1, "prompt_logprobs": 0},
        {"logit_bias": {5: -100, 6: 100.0}},
        {"allowed_token_ids": [1, 2], "bad_words": ["x"]},
        {"seed": -(2**63)},
        {"seed": 2**63 - 1},
    ],
)
def test_valid_edges(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_from_generation_config() -> None:
    gen = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": None,
        "repetition_penalty": 1.1,
        "max_new_tokens": 64,
        "do_sample": True,
        "eos_token_id": [1, 2],
    }
    sp = SamplingParams.from_generation_config(gen, top_p=0.5)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.6, 0.5, 20, 0.0)
    assert (sp.repetition_penalty, sp.max_tokens) == (1.1, 64)
    assert SamplingParams.from_generation_config({}) == SamplingParams()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_generation_config({"temperature": -1.0})


def test_validate_token_ids() -> None:
    SamplingParams(
        stop_token_ids=[0, 9], allowed_token_ids=[3], logit_bias={9: 1}
    ).validate_token_ids(10)
    for kwargs, name in [
        ({"stop_token_ids": [10]}, "stop_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"logit_bias": {12: 1.0}}, "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=rf"{name} must hold token ids in \[0, 10\)"):
            SamplingParams(**kwargs).validate_token_ids(10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
        ({"json": {}, "regex": "a"}, "got json, regex"),
        ({"json": 5}, "structured_outputs.json must be a schema"),
        ({"json_object": 1}, "structured_outputs.json_object must be a bool"),
        ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
        ({"choice": []}, "structured_outputs.choice must not be empty"),
    ],
)
def test_invalid_structured_outputs(kwargs: dict, message: str) -> None:
    from kvik.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)
