"""A model's recommended sampling (its generation_config.json) applies where a request leaves an
option unset: ``LLM.generate``/``chat`` without ``SamplingParams`` and server requests; the
``generation_config`` option turns it off ("vllm"/"none") or reads another folder."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tiny_models import build_tiny_model, ragged_prompts

from kvik import LLM, SamplingParams
from kvik.engine.async_llm import AsyncLLM


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory):
    """A tiny Llama whose generation config asks for greedy decoding and 5 new tokens."""
    folder = build_tiny_model("llama", tmp_path_factory.mktemp("greedy-llama"))
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5, "bos_token_id": 1})
    )
    return folder


def test_generate_without_params_takes_the_models_defaults(greedy_model):
    llm = LLM(str(greedy_model), dtype="float32", num_kv_blocks=64)
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(3, seed=4)]
    defaulted = llm.generate(prompts, use_tqdm=False)
    explicit = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in defaulted] == [5, 5, 5]
    assert [o.outputs[0].token_ids for o in defaulted] == [o.outputs[0].token_ids for o in explicit]
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)


def test_generation_config_vllm_keeps_kvik_defaults(greedy_model, tmp_path):
    llm = LLM(str(greedy_model), dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 3}))
    other = LLM(
        str(greedy_model), dtype="float32", num_kv_blocks=64, generation_config=str(tmp_path)
    )
    assert other.get_default_sampling_params() == SamplingParams(top_k=3)


def test_server_requests_leave_unset_options_to_the_model():
    """The server's SamplingParams: the request's fields, else the model's, else the API's."""
    from kvik_server.protocol import ChatCompletionRequest, CompletionRequest
    from kvik_server.serving import sampling_params

    model = SimpleNamespace(
        sampling_defaults={"temperature": 0.6, "top_k": 20, "max_new_tokens": 9}
    )
    engine = SimpleNamespace(config=SimpleNamespace(model=model))
    engine.get_default_sampling_params = AsyncLLM.get_default_sampling_params.__get__(engine)
    plain = CompletionRequest(model="m", prompt="hi")
    params = sampling_params(engine, plain, plain.max_tokens, 16, None)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 1.0, 9)
    chosen = CompletionRequest(model="m", prompt="hi", temperature=0.0, max_tokens=3)
    params = sampling_params(engine, chosen, chosen.max_tokens, 16, None)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 20, 3)
    model.sampling_defaults = {}
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    params = sampling_params(engine, chat, None, None, None)
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, None)
