"""The server through the official openai client: the same outputs as the offline LLM."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time

import httpx
import openai
import pytest
from server_process import ServerProcess
from tiny_models import build_tiny_model, save_tiny_tokenizer

from kvik import LLM, SamplingParams

KEY = "test-key"
#: float32 on both sides: the CPU's "auto" is bfloat16 where it has AVX512-BF16, and in bfloat16 a
#: prompt computed whole and one read partly from the prefix cache differ by up to ~7e-3 in a
#: logprob, so a comparison at 1e-4 depended on which requests each engine had seen before.
ENGINE = ["--num-kv-blocks", "128", "--max-model-len", "256", "--max-body-bytes", "65536"]
ENGINE += ["--dtype", "float32"]
#: The module's server runs chat templates sent with requests (the tests send some).
TRUSTING = ["--trust-request-chat-template"]
PROMPTS = ["Hello world", "The cat", "1, 2, 3,", "abc"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build_tiny_model("llama", tmp_path_factory.mktemp("chat-llama"))
    return save_tiny_tokenizer(folder)


@pytest.fixture(scope="module")
def server(model):
    server = ServerProcess(model, *ENGINE, *TRUSTING, api_key=KEY).wait_ready()
    yield server
    server.stop_and_check()


@pytest.fixture(scope="module")
def offline(model):
    return LLM(
        str(model), num_kv_blocks=128, max_model_len=256, enforce_eager=True, dtype="float32"
    )


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_engine_runs_in_another_process(server):
    assert server.engine_pid() not in (server.process.pid, os.getpid())


def test_models_version_tokenize(server, client, model, offline):
    assert [m.id for m in client.models.list()] == [str(model)]
    http = httpx.Client(base_url=server.url, headers=server.headers)
    assert http.get("/version").json()["version"]
    tokens = http.post("/tokenize", json={"prompt": "Hello"}).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode("Hello")
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello"
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    prompt = offline.input_processor.apply_chat_template(MESSAGES)
    assert chat["tokens"] == prompt["prompt_token_ids"]
    # A request's own template, as the chat route takes it (it was ignored).
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    own = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": template}).json()
    assert own["tokens"] == offline.get_tokenizer().encode(
        MESSAGES[0]["content"], add_special_tokens=False
    )


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_offline(client, offline, stream):
    expected = offline.generate(PROMPTS, greedy(logprobs=2), use_tqdm=False)
    kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPTS, max_tokens=8)
    kwargs |= dict(temperature=0, logprobs=2)
    if stream:
        texts, logprobs, usage = ["" for _ in PROMPTS], [[] for _ in PROMPTS], None
        finish = [None for _ in PROMPTS]
        for chunk in client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                logprobs[choice.index] += choice.logprobs.token_logprobs
                finish[choice.index] = choice.finish_reason or finish[choice.index]
    else:
        response = client.completions.create(**kwargs)
        choices = sorted(response.choices, key=lambda c: c.index)
        texts = [c.text for c in choices]
        logprobs = [c.logprobs.token_logprobs for c in choices]
        finish = [c.finish_reason for c in choices]
        usage = response.usage
    assert texts == [r.outputs[0].text for r in expected]
    assert finish == [r.outputs[0].finish_reason for r in expected]
    for got, want in zip(logprobs, expected):
        offline_lps = [next(iter(d.values())).logprob for d in want.outputs[0].logprobs]
        assert got == pytest.approx(offline_lps, abs=1e-4)
    assert usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in expected)
    assert usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in expected)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline(client, offline, stream):
    (expected,) = offline.chat(MESSAGES, greedy(logprobs=3), use_tqdm=False)
    kwargs = dict(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=8)
    kwargs |= dict(temperature=0, logprobs=True, top_logprobs=3)
    if stream:
        text, tokens, usage = "", [], None
        for chunk in client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        ):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                tokens += choice.logprobs.content if choice.logprobs else []
    else:
        response = client.chat.completions.create(**kwargs)
        text = response.choices[0].message.content
        tokens = response.choices[0].logprobs.content
        usage = response.usage
    assert text == expected.outputs[0].text
    want = expected.outputs[0].logprobs
    assert [t.logprob for t in tokens] == pytest.approx(
        [next(iter(d.values())).logprob for d in want], abs=1e-4
    )
    assert all(len(t.top_logprobs) == 3 for t in tokens)
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_prompt_logprobs_and_echo_with_logprobs(server, client, offline):
    """``prompt_logprobs`` come back per choice (vLLM's shape: None for the first token, then the
    prompt's token and the top ones by id) equal to the offline engine's; ``echo`` with
    ``logprobs`` puts the prompt's tokens before the generated ones (the first has none), in the
    answer and in the stream's first chunk."""
    (expected,) = offline.generate("The cat", greedy(4, logprobs=1, prompt_logprobs=2), False)
    want = expected.prompt_logprobs
    model = client.models.list().data[0].id
    http = httpx.Client(base_url=server.url, headers=server.headers)
    body = {"model": model, "prompt": "The cat", "max_tokens": 4, "temperature": 0}
    got = http.post("/v1/completions", json=body | {"prompt_logprobs": 2}).json()
    entries = got["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(expected.prompt_token_ids) == len(want)
    for token_id, entry, offline_entry in zip(expected.prompt_token_ids[1:], entries[1:], want[1:]):
        assert str(token_id) in entry
        for key, value in entry.items():
            assert value["logprob"] == pytest.approx(offline_entry[int(key)].logprob, abs=1e-4)
    echoed = http.post("/v1/completions", json=body | {"echo": True, "logprobs": 1}).json()
    logprobs = echoed["choices"][0]["logprobs"]
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs["tokens"]) == num_prompt + len(expected.outputs[0].token_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    prompt_values = [e[t].logprob for t, e in zip(expected.prompt_token_ids[1:], want[1:])]
    assert logprobs["token_logprobs"][1:num_prompt] == pytest.approx(prompt_values, abs=1e-4)
    generated = [next(iter(d.values())).logprob for d in expected.outputs[0].logprobs]
    assert logprobs["token_logprobs"][num_prompt:] == pytest.approx(generated, abs=1e-4)
    assert echoed["choices"][0]["text"].startswith("The cat")
    stream = client.completions.create(
        model=model, prompt="The cat", max_tokens=4, temperature=0, echo=True, logprobs=1,
        stream=True,
    )  # fmt: skip
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    first = chunks[0]
    assert first.text == "The cat" and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(prompt_values, abs=1e-4)
    # The generated tokens' offsets follow the echoed prompt's, as unstreamed (they restarted
    # at 0).
    offsets = [offset for c in chunks if c.logprobs for offset in c.logprobs.text_offset]
    assert offsets == logprobs["text_offset"]
    chat = http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    prompt = offline.input_processor.apply_chat_template(MESSAGES)["prompt_token_ids"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(prompt)
    # Every prompt logprob of the vocabulary (-1) would be vocabulary x prompt entries in one
    # answer: beyond max_logprobs (20 by default), a 400.
    refused = http.post("/v1/completions", json=body | {"prompt_logprobs": -1})
    assert refused.status_code == 400 and "max_logprobs=20" in refused.json()["error"]["message"]


def test_n_and_stop(client, offline):
    params = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=6, stop=["a"])
    (expected,) = offline.generate("Hello", params, use_tqdm=False)
    response = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="Hello",
        n=3,
        temperature=0.8,
        seed=7,
        max_tokens=6,
        stop=["a"],
    )
    got = {c.index: c.text for c in response.choices}
    assert got == {o.index: o.text for o in expected.outputs}


def post_json(server, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON (``json.dumps``' escapes, lone surrogates included: httpx's own
    encoder cannot write those)."""
    headers = server.headers | {"Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=headers)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "best_of": 2}, "best_of"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": [], "max_tokens": 2}, "prompt"),
        ({"prompt": [[1, 2], [300]], "max_tokens": 2}, "prompt"),
        ({"prompt": "x" * 300, "max_tokens": 2}, None),
        ({"prompt": "hi", "logit_bias": {"a": 1}}, "logit_bias"),
        # The engine's errors name the field in param too (it was null).
        ({"prompt": "hi", "logit_bias": {"999": 1}}, "logit_bias"),
        ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": 2}, "prompt"),
        # Past the int64 seeds the engine's messages carry (was a 500).
        ({"prompt": "hi", "seed": 2**70, "max_tokens": 2}, "seed"),
        ({"prompt": "hi", "priority": 10**30, "max_tokens": 2}, "priority"),
        # Past int64, the other ints the engine's messages carry were 500s too.
        ({"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
        ({"prompt": "hi", "top_k": 2**70, "max_tokens": 2}, "top_k"),
        ({"prompt": "hi", "min_tokens": 2**70}, "min_tokens"),
        ({"prompt": "hi", "best_of": 0}, "best_of"),  # was silently ignored
        # No chunk of a stream carries them: they were silently left out.
        ({"prompt": "hi", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        # This server schedules fcfs: a priority was silently ignored.
        ({"prompt": "hi", "priority": 1, "max_tokens": 2}, "priority"),
        # vLLM's old guided fields were ignored: the output was silently unconstrained.
        ({"prompt": "hi", "guided_json": {"type": "object"}}, "guided_json"),
        ({"prompt": "hi", "guided_choice": ["a", "b"]}, "guided_choice"),
        # JSON can carry a lone UTF-16 surrogate; the tokenizer cannot (was a 500).
        ({"prompt": "hi \ud800", "max_tokens": 2}, None),
    ],
)
def test_bad_completion_requests_get_400(server, body, param):
    response = post_json(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "body, message",
    [
        ({"chat_template": "{{ raise_exception('no system messages') }}"}, "no system messages"),
        ({"chat_template": "{% for %}"}, "TemplateSyntaxError"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "may not set"),
        ({"chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
        # Arguments transformers passes itself, and ones that fail in Python rather than in
        # jinja: each was a 500.
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
        ({"chat_template_kwargs": {"tools": 5}}, "may not set tools"),
        ({"chat_template_kwargs": {"documents": 5}}, "chat_template_kwargs: TypeError"),
        ({"chat_template": "{{ 1 / 0 }}"}, "ZeroDivisionError"),
        ({"priority": -1}, "--scheduling-policy priority"),
        ({"guided_regex": "[0-9]+"}, 'structured_outputs {"regex": ...}'),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "needs a string"),
        ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "name must be a string"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "lone surrogate"),
        ({"stream": True, "prompt_logprobs": 2}, "not available when stream is true"),
    ],
)
def test_bad_chat_requests_get_400(server, body, message):
    """Templates that fail, template arguments kvik sets itself, malformed parts and text: the
    request's fault, each a 400 naming it (each was a 500)."""
    body = {"messages": MESSAGES, "max_tokens": 2} | body
    response = post_json(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 300}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 256}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": 1000, "max_tokens": 2},
            "max_completion_tokens",
        ),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 300}, "max_output_tokens"),
    ],
)
def test_max_tokens_past_the_context_is_a_400(server, path, body, param):
    """A limit the client set that the prompt leaves no room for is refused as vLLM refuses it
    (it was silently cut to the room left); the server's own default is still cut to fit."""
    response = post_json(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert f"{param} is too large" in error["message"]
    assert "maximum context length is 256 tokens" in error["message"]


def test_a_default_max_tokens_is_cut_to_the_context(server):
    """Without max_tokens a chat may run to the end of the context: the room left, not a 400."""
    body = {"messages": MESSAGES, "temperature": 0, "ignore_eos": True}
    response = post_json(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_completions_without_special_tokens(server):
    """add_special_tokens=false reaches the engine as token ids without them (it was ignored)."""
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "echo": True}
    bare = post_json(server, "/v1/completions", body | {"add_special_tokens": False}).json()
    tokens = post_json(server, "/tokenize", {"prompt": "Hello", "add_special_tokens": False})
    assert bare["usage"]["prompt_tokens"] == tokens.json()["count"]
    assert bare["choices"][0]["text"].startswith("Hello")
    plain = post_json(server, "/v1/completions", body).json()
    assert plain["choices"][0]["text"] == bare["choices"][0]["text"]  # the tokenizer adds none


def test_text_parts_are_joined_as_vllm_joins_them(client):
    """Content as a list of text parts (the openai client's typed form) reaches the template as
    one string, the parts joined by newlines: the same answer as that string (it was a 500 with
    every string-content template)."""
    model = client.models.list().data[0].id
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "text", "text": "of France?"},
    ]
    answers = [
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=6,
            temperature=0,
        ).choices[0].message.content
        for content in (parts, "What is the capital\nof France?")
    ]  # fmt: skip
    assert answers[0] == answers[1] and answers[0]


def test_error_statuses(server):
    h = server.headers | {"Content-Type": "application/json"}
    post = httpx.post
    malformed = post(f"{server.url}/v1/completions", content=b'{"prompt": ', headers=h)
    assert malformed.status_code == 400 and "JSON" in malformed.json()["error"]["message"]
    tools = {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert post(f"{server.url}/v1/chat/completions", json=tools, headers=h).status_code == 400
    unknown_model = post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "model": "nope"}, headers=h
    )
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.url}/v1/nothing", headers=h).status_code == 404
    big = post(f"{server.url}/v1/completions", json={"prompt": "x" * 70000}, headers=h)
    assert big.status_code == 413 and big.json()["error"]["code"] == 413


#: Constraints that leave no token to sample, the param a 400 names and the message's start.
#: Each came back as a 200 with finish_reason "abort", an empty text and 1 completion token.
NO_TOKEN = [
    (
        {"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}},
        "structured_outputs",
        "the structured output constraint (regex) admits no token",
    ),
    (
        {"allowed_token_ids": [5], "structured_outputs": {"choice": ["zz"]}},
        "allowed_token_ids",
        "allowed_token_ids leave no token",
    ),
]


def sse_data(server, path: str, body: dict) -> list[str]:
    """A streamed answer's ``data:`` payloads (its status must be 200: the stream began)."""
    headers = server.headers | {"Content-Type": "application/json"}
    with httpx.stream(
        "POST", f"{server.url}{path}", content=json.dumps(body), headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("extra, param, message", NO_TOKEN)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_admits_no_token_is_a_400(server, extra, param, message, stream):
    """Completions, chat and Responses: a 400 naming the cause and the field at fault; in a
    stream, an error event with the same, then the end. Meanwhile a valid request beside them
    runs to its end."""
    valid = {"prompt": "Once upon", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(post_json, server, "/v1/completions", valid)
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 5}),
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5}),
        ):
            body = body | extra | ({"stream": True} if stream else {})
            if stream:
                *events, done = sse_data(server, path, body)
                assert done == "[DONE]"
                error = json.loads(events[-1])["error"]
                assert all("choices" in json.loads(event) for event in events[:-1])
            else:
                response = post_json(server, path, body)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
            assert error["message"].startswith(message), error
            assert (error["param"], error["code"], error["type"]) == (param, 400, "BadRequestError")
        answer = beside.result()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert answer.json()["usage"]["completion_tokens"] == 40


#: A JSON schema nothing can follow after its opening quote: its constraint fails after 1 token.
EMPTY_STRING_SCHEMA = {"type": "string", "pattern": "[^\\s\\S]"}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_with_a_constraint_that_admits_no_token(server, stream):
    """/v1/responses: a text.format that leaves nothing to sample is a 400 naming text.format (a
    stream: an error event, after the text so far); a response_format in chat names itself."""
    fmt = {"type": "json_schema", "name": "x", "schema": EMPTY_STRING_SCHEMA}
    body = {"input": "hi", "max_output_tokens": 5, "text": {"format": fmt}}
    chat = {
        "messages": MESSAGES,
        "max_tokens": 5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": EMPTY_STRING_SCHEMA},
        },
    }
    message = "the structured output constraint (json) admits no token after 1 output token"
    if stream:
        events = [json.loads(e) for e in sse_data(server, "/v1/responses", body | {"stream": True})]
        assert events[-1]["type"] == "error" and events[-1]["code"] == "400"
        assert events[-1]["param"] == "text.format"
        assert events[-1]["message"].startswith(message)
        assert not any(e["type"] == "response.completed" for e in events)
        *chunks, done = sse_data(server, "/v1/chat/completions", chat | {"stream": True})
        error = json.loads(chunks[-1])["error"]
    else:
        response = post_json(server, "/v1/responses", body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["message"].startswith(message)) == ("text.format", True)
        response = post_json(server, "/v1/chat/completions", chat)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    assert (error["param"], error["message"].startswith(message)) == ("response_format", True)


def test_every_route_needs_the_key_but_health(server, model):
    from kvik.engine.args import EngineArgs
    from kvik_server.app import create_app

    paths = {route.path for route in create_app(EngineArgs(model=str(model))).routes}
    assert {"/v1/completions", "/v1/chat/completions", "/metrics", "/health"} <= paths
    for path in sorted(paths) + ["/no/such/route"]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method in ("GET", "POST"):
                response = httpx.request(method, f"{server.url}{path}", headers=headers)
                if path == "/health":
                    assert response.status_code == (200 if method == "GET" else 405)
                else:
                    assert response.status_code == 401, (method, path, headers)
                    assert response.json()["error"]["type"] == "AuthenticationError"


def test_64_concurrent_streams_are_batched(server, offline, model):
    prompts = [f"Request {i}: " + "ab" * (i % 5) for i in range(64)]
    expected = [r.outputs[0].text for r in offline.generate(prompts, greedy(), use_tqdm=False)]
    peak, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], server.metrics().get("kvik:num_requests_running", 0))
            time.sleep(0.02)

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int = 8) -> str:
        text = ""
        stream = await client.completions.create(
            model=str(model), prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def malformed(http: httpx.AsyncClient) -> list[int]:
        headers = server.headers | {"Content-Type": "application/json"}
        bodies = [
            b"{",
            b'{"prompt": 5}',
            b'{"prompt": "x", "n": 0}',
            b'{"prompt": "x", "top_k": -5}',
        ]
        return [
            (await http.post("/v1/completions", content=body, headers=headers)).status_code
            for body in bodies
        ]

    def async_client() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key=KEY,
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=100)),
        )

    async def run() -> tuple[list[str], list[int]]:
        client = async_client()
        async with httpx.AsyncClient(base_url=server.url) as http:
            results = await asyncio.gather(*(one(client, p) for p in prompts), malformed(http))
        return results[:-1], results[-1]

    async def run_long() -> list[str]:
        # 96 steps each: requests that arrive together are still running together when the
        # watcher looks, however fast the tiny model's steps are (8 tokens can all finish between
        # two looks on a busy machine). Their texts are not compared: in bf16 a long output
        # depends on the batch it ran in.
        client = async_client()
        return await asyncio.gather(*(one(client, p, max_tokens=96) for p in prompts))

    texts, statuses = asyncio.run(run())
    assert texts == expected
    assert statuses == [400, 400, 400, 400]
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        long_texts = asyncio.run(run_long())
    finally:
        done.set()
        watcher.join()
    assert all(long_texts)
    assert peak[0] > 1


@pytest.fixture(scope="module")
def default_model_server():
    """The default model, whose steps are far longer than the tiny model's: a 200-token request
    is still running when the client has read two chunks, which the tiny model's steps do not
    promise on a busy machine."""
    server = ServerProcess("smollm2-135m-instruct", "--max-model-len", "512", api_key=KEY)
    server.wait_ready()
    yield server
    server.stop_and_check()


def test_client_disconnect_aborts(default_model_server):
    server = default_model_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    before = server.metrics()
    stream = client.completions.create(
        model="smollm2-135m-instruct",
        prompt="Tell me a long story",
        max_tokens=200,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert server.metrics()["kvik:num_requests_running"] == 1
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = server.metrics()
        if now["kvik:num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert now["kvik:num_requests_running"] == 0
    assert now["kvik:kv_cache_usage_perc"] == before["kvik:kv_cache_usage_perc"]
    assert now["kvik:generation_tokens_total"] - before["kvik:generation_tokens_total"] < 200


def test_request_chat_templates_need_the_operators_leave(default_model_server):
    """A server started without --trust-request-chat-template answers a chat or tokenize request
    that carries its own chat_template with a 400 naming the field and the flag (a template is
    code the server would run); the same request without it is served."""
    server = default_model_server
    messages = [{"role": "user", "content": "Hi"}]
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for path, body in (
        ("/v1/chat/completions", {"model": "smollm2-135m-instruct", "max_tokens": 1}),
        ("/tokenize", {}),
    ):
        refused = post_json(server, path, {**body, "messages": messages, "chat_template": template})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]
        assert post_json(server, path, {**body, "messages": messages}).status_code == 200
