"""Streaming through the official openai client against ``kvik serve`` on the default model: no
empty chunks, concurrent streams that all complete with the texts the server gives unstreamed, and
``/metrics`` histograms that count what the client saw."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

from kvik import SamplingParams
from kvik.bench.server_metrics import SERVER_HISTOGRAMS, parse_histograms
from kvik.model_loader.default_model import ALIAS

KEY = "streaming-key"
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def server():
    # fp32: the texts of concurrent and lone requests are compared exactly.
    server = ServerProcess(ALIAS, "--max-model-len", "512", "--dtype", "float32", api_key=KEY)
    server.wait_ready(timeout_s=600)
    yield server
    server.stop_and_check()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_completion_stream_has_no_empty_chunks(client):
    chunks = list(
        client.completions.create(
            model=ALIAS, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    *deltas, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 24
    for chunk in deltas:
        (choice,) = chunk.choices
        assert choice.text or choice.finish_reason, chunk
    assert deltas[-1].choices[0].finish_reason == "length"
    full = client.completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in deltas) == full.choices[0].text


def test_chat_stream_has_no_empty_chunks_and_the_role_first(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    chunks = list(
        client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=20, temperature=0, stream=True,
            logprobs=True, top_logprobs=2,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    for chunk in chunks:
        (choice,) = chunk.choices
        # Logprobs were asked for, so a chunk may carry them alone (a token with no whole
        # character yet); otherwise text or the finish reason.
        assert choice.delta.content or choice.finish_reason or choice.logprobs.content, chunk
    tokens = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs)
    full = client.chat.completions.create(
        model=ALIAS, messages=messages, max_tokens=20, temperature=0
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        full.choices[0].message.content
    )
    assert tokens == full.usage.completion_tokens


def test_concurrent_streams_complete_with_the_right_texts(server, client):
    """Four streams of two choices each at once, and two plain requests among them: each stream's
    chunks add up to the text the server gives the same prompt alone and unstreamed."""
    alone = [
        client.completions.create(model=ALIAS, prompt=p, max_tokens=16, temperature=0).choices[0]
        for p in PROMPTS
    ]

    async def stream(aclient, prompt: str) -> tuple[list[str], list[str | None], int]:
        texts, finish, chunks = ["", ""], [None, None], 0
        response = await aclient.completions.create(
            model=ALIAS, prompt=prompt, max_tokens=16, temperature=0, n=2, stream=True
        )
        async for chunk in response:
            chunks += 1
            for choice in chunk.choices:
                assert choice.text or choice.finish_reason
                texts[choice.index] += choice.text
                finish[choice.index] = choice.finish_reason or finish[choice.index]
        return texts, finish, chunks

    async def plain(aclient, prompt: str) -> str:
        response = await aclient.completions.create(
            model=ALIAS, prompt=prompt, max_tokens=16, temperature=0
        )
        return response.choices[0].text

    async def run():
        aclient = async_client(server)
        return await asyncio.gather(
            *(stream(aclient, p) for p in PROMPTS), plain(aclient, PROMPTS[1]),
            plain(aclient, PROMPTS[3]),
        )  # fmt: skip

    *streams, plain_1, plain_3 = asyncio.run(run())
    for (texts, finish, chunks), want in zip(streams, alone):
        assert texts == [want.text, want.text]
        assert finish == [want.finish_reason, want.finish_reason]
        assert chunks >= 2
    assert (plain_1, plain_3) == (alone[1].text, alone[3].text)


def histograms(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=5).text
    return parse_histograms(text)


def test_metrics_histograms_count_what_the_client_saw(server):
    # ms-level buckets below 50 ms, so a median near 10 ms is read to better than 10%.
    before = histograms(server)
    for name in SERVER_HISTOGRAMS.values():
        bounds = sorted(before[name].buckets)
        assert [b for b in bounds if b <= 0.02] == [i / 1000 for i in range(1, 21)]
        gaps = [(hi - lo) / hi for lo, hi in zip(bounds, bounds[1:]) if 0.02 <= hi <= 10]
        assert max(gaps) < 0.12
    lengths = [5, 9, 17, 3]

    async def one(aclient, prompt: str, max_tokens: int) -> tuple[int, float, float]:
        start = time.monotonic()
        response = await aclient.completions.create(
            model=ALIAS, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        first, tokens = None, 0
        async for chunk in response:
            if chunk.choices and first is None:
                first = time.monotonic() - start
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens, first, time.monotonic() - start

    async def run():
        aclient = async_client(server)
        return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(PROMPTS, lengths)))

    seen = asyncio.run(run())
    after = histograms(server)
    assert [tokens for tokens, _, _ in seen] == lengths

    def run_of(metric: str):
        name = SERVER_HISTOGRAMS[metric]
        return after[name].minus(before[name])

    assert run_of("ttft").count == len(lengths)
    assert run_of("e2el").count == len(lengths)
    assert run_of("tpot").count == len(lengths)  # every request made more than one token
    assert run_of("itl").count == sum(n - 1 for n in lengths)
    # The server's clock starts when the HTTP request comes in and stops when the token leaves
    # the engine, inside the client's: its sums are at most the client's.
    assert 0 < run_of("ttft").sum <= sum(first for _, first, _ in seen)
    assert 0 < run_of("e2el").sum <= sum(e2e for _, _, e2e in seen)
    assert run_of("e2el").sum >= run_of("ttft").sum


def test_a_token_without_text_yet_still_gets_its_chunk():
    """Clients (and `kvik bench serve`) time tokens by chunks: a token whose text is still empty
    (a character's first bytes, a stop string's possible start, a model without a tokenizer) is a
    chunk; a step that gave a choice nothing is not."""
    from kvik.outputs import CompletionOutput
    from kvik_server.serving import _worth_a_chunk

    def delta(text: str, token_ids: list[int], finish: str | None = None) -> CompletionOutput:
        return CompletionOutput(0, text, token_ids, None, finish)

    assert _worth_a_chunk(delta("", [17]))
    assert _worth_a_chunk(delta(" Paris", [17]))
    assert _worth_a_chunk(delta("", [], "stop"))
    assert not _worth_a_chunk(delta("", []))


def gauge(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


def test_a_stream_answers_before_its_first_token_and_still_refuses_bad_input(server, client):
    """A streamed request's headers go out once its prompt is validated and queued, not after its
    first token: bad input is still a 400 before any stream, and a client that leaves before its
    first token leaves no request behind in the engine."""
    with pytest.raises(openai.BadRequestError, match="max_model_len|longer|context"):
        client.completions.create(model=ALIAS, prompt="hello " * 2000, max_tokens=4, stream=True)
    body = {"model": ALIAS, "prompt": "hello " * 400, "max_tokens": 64, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200  # left here, before any chunk is read
    deadline = time.monotonic() + 60
    while gauge(server, "kvik:num_requests_running") + gauge(server, "kvik:num_requests_waiting"):
        assert time.monotonic() < deadline, "the abandoned stream's request is still in the engine"
        time.sleep(0.2)
    again = client.completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason == "length"


# The serving layer driven with exact token ids: a real OutputProcessor (the default model's
# tokenizer) makes the engine's outputs, delta ones for a stream and one final for an unstreamed
# answer, and the routes' own code turns them into chunks and bodies.


class _Engine:
    """What the routes read of AsyncLLM besides generate()."""

    def __init__(self, tokenizer) -> None:
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.config = SimpleNamespace(structured_outputs=SimpleNamespace(reasoning_parser=None))


@pytest.fixture(scope="module")
def tokenizer():
    from kvik.engine.input_processor import load_tokenizer
    from kvik.model_loader.default_model import default_model_path

    return load_tokenizer(default_model_path())


async def _engine_outputs(tokenizer, prompt, steps, params, kind):
    """(0, RequestOutput) as AsyncLLM.generate gives them for ``steps`` (token ids per engine
    step; the request ends "length" after the last, or earlier at a stop string)."""
    from kvik.engine.output_processor import OutputProcessor
    from kvik.outputs import RequestOutput
    from kvik.scheduler.output import EngineCoreOutput, TokenLogprobs

    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    state = processor.add_request("r", prompt, prompt_ids, params)
    for k, ids in enumerate(steps):
        logprobs = [TokenLogprobs([t], [-0.5], [1]) for t in ids]
        finish = "length" if k == len(steps) - 1 else None
        processor.process_outputs([EngineCoreOutput("r", ids, finish, new_logprobs=logprobs)])
        if kind == "delta":
            out = RequestOutput("r", prompt, prompt_ids, [state.delta_completion()])
            out.finished = state.finished
            yield 0, out
        if state.finished:
            break
    if kind == "final":
        yield 0, RequestOutput("r", prompt, prompt_ids, [state.completion()], finished=True)


def _served_completion(
    tokenizer, body: dict, steps: list[list[int]], stream_options: dict | None = None
) -> tuple[dict, list[dict]]:
    """The unstreamed answer's body and the stream's chunks for ``body`` on ``steps``."""
    import json

    from kvik_server.protocol import CompletionRequest
    from kvik_server.serving import Completions

    routes = Completions(_Engine(tokenizer), ALIAS)

    async def run():
        request = CompletionRequest.model_validate({"model": ALIAS, **body})
        params = SamplingParams(max_tokens=64, logprobs=request.logprobs, stop=request.stop)
        final = await routes._collect(
            request, "c", _engine_outputs(tokenizer, request.prompt, steps, params, "final"), 1
        )
        streamed = {"stream": True, "stream_options": stream_options, **body}
        request = CompletionRequest.model_validate({"model": ALIAS, **streamed})
        events = _engine_outputs(tokenizer, request.prompt, steps, params, "delta")
        chunks = [
            json.loads(event.removeprefix("data: "))
            async for event in routes._stream(request, "c", events, 1)
        ]
        return final.model_dump(), chunks

    return asyncio.run(run())


def test_streamed_logprob_offsets_are_the_unstreamed_ones(tokenizer):
    """A stream's text_offset restarted each chunk from the length of the text streamed so far,
    which lags behind the tokens' texts while text is held back (a stop string's possible
    start, the first bytes of a character): the offsets differed from the unstreamed answer's."""
    text = " Tokyo 東京 🙂, see you soon!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for echo in (False, True):
        body = {"prompt": "Say:", "logprobs": 1, "echo": echo, "stop": ["never said"]}
        final, chunks = _served_completion(tokenizer, body, [[i] for i in ids])
        (choice,) = final["choices"]
        want = choice["logprobs"]
        got = {key: [] for key in want}
        for chunk in chunks:
            for key in got:
                got[key] += chunk["choices"][0]["logprobs"][key]
        assert got == want
        assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == choice["text"]


def test_continuous_usage_stats_give_every_chunk_its_usage_so_far(tokenizer):
    """vLLM's ``stream_options.continuous_usage_stats`` (with include_usage) puts the usage so
    far on every chunk; it was ignored, so no chunk but the last had any."""
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    steps = [ids[:2], ids[2:3], ids[3:]]
    options = {"include_usage": True, "continuous_usage_stats": True}
    final, chunks = _served_completion(tokenizer, {"prompt": "Count:"}, steps, options)
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"] == final["usage"]
    prompt_tokens = final["usage"]["prompt_tokens"]
    assert [chunk["usage"] for chunk in deltas] == [
        {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        for n in (2, 3, len(ids))
    ]
    # Without include_usage, continuous_usage_stats alone adds nothing (as vLLM).
    _, chunks = _served_completion(
        tokenizer, {"prompt": "Count:"}, steps, {"continuous_usage_stats": True}
    )
    assert all(chunk["usage"] is None for chunk in chunks)


def test_chat_logprob_bytes_join_into_the_text(tokenizer):
    """OpenAI's ``bytes`` let a client put back a character split over tokens: each token's own
    UTF-8 bytes. A token holding part of a character decodes alone to U+FFFD, and its bytes were
    U+FFFD's (EF BF BD), so joined they made "\ufffd\ufffd" where the text has "東"."""
    import json

    from kvik_server.protocol import ChatCompletionRequest
    from kvik_server.serving import ChatCompletions, _ParserFactory

    text = " 東京 🙂 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)
    routes = ChatCompletions(_Engine(tokenizer), ALIAS, None)
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    params = SamplingParams(max_tokens=64, logprobs=0)

    async def outputs(kind):
        async for _, out in _engine_outputs(tokenizer, "Hi", [[i] for i in ids], params, kind):
            yield out

    async def run():
        parsers = _ParserFactory(routes.engine, None, None)
        request = ChatCompletionRequest.model_validate(body)
        final = await routes._collect(request, "c", outputs("final"), 0, parsers)
        request = ChatCompletionRequest.model_validate(body | {"stream": True})
        events = routes._stream(request, "c", outputs("delta"), 0, parsers)
        chunks = [json.loads(event.removeprefix("data: ")) async for event in events]
        return final.model_dump(), chunks

    final, chunks = asyncio.run(run())
    (choice,) = final["choices"]
    assert choice["message"]["content"] == text
    unstreamed = choice["logprobs"]["content"]
    streamed = [t for chunk in chunks for t in chunk["choices"][0]["logprobs"]["content"]]
    for tokens in (unstreamed, streamed):
        assert bytes(b for token in tokens for b in token["bytes"]).decode() == text
