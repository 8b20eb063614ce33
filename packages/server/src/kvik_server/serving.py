"""OpenAI's completions and chat completions on top of AsyncLLM: request fields to SamplingParams,
engine outputs to response bodies and server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from kvik.engine.async_llm import AsyncLLM, EngineDeadError
from kvik.engine.input_processor import encode_text
from kvik.outputs import CompletionOutput, Logprob, RequestError, RequestOutput
from kvik.sampling_params import SamplingParams
from kvik_server.errors import APIError, error_body
from kvik_server.output_parsing import OutputParser, output_parser
from kvik_server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    ToolCall,
    TopLogprob,
    Usage,
    random_id,
)
from kvik_server.structured_outputs import refuse_old_guided_fields, structured_outputs_params
from kvik_server.token_bytes import TokenBytes
from kvik_server.tools.choice import (
    FunctionTool,
    ToolOptions,
    ToolPlan,
    apply_tool_plan,
    parse_tools,
    plan_tools,
)
from kvik_server.tools.messages import template_messages

#: Template arguments that transformers passes itself, from the request's messages and tools.
_REQUEST_TEMPLATE_KWARGS = frozenset({"messages", "tools"})

_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(
    engine: AsyncLLM,
    request: SamplingFields,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    """The request's SamplingParams over the model's generation_config defaults, as vLLM does."""
    refuse_old_guided_fields(request)
    if request.stream and request.prompt_logprobs not in (None, 0):
        # No chunk carries them: a stream silently lacked what the unstreamed answer holds.
        raise APIError(
            "prompt_logprobs are not available when stream is true (as in vLLM)",
            param="prompt_logprobs",
        )
    if request.logit_bias is not None:
        try:
            logit_bias = {int(token): bias for token, bias in request.logit_bias.items()}
        except ValueError:
            raise APIError("logit_bias keys must be token ids", param="logit_bias") from None
    else:
        logit_bias = None
    overrides: dict[str, Any] = {
        name: getattr(request, name)
        for name in _OPTIONAL_SAMPLING
        if getattr(request, name) is not None
    }
    if max_tokens is None:
        max_tokens = engine.config.model.sampling_defaults.get("max_new_tokens", default_max_tokens)
    return engine.get_default_sampling_params(
        **overrides,
        n=request.n,
        max_tokens=max_tokens,
        seed=request.seed,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids or [],
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=logit_bias,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        structured_outputs=structured_outputs_params(
            request.response_format, request.structured_outputs
        ),
    )


def check_priority(engine: AsyncLLM, priority: int) -> None:
    """A priority other than 0 needs a server that schedules by it: under fcfs it was silently
    ignored (vLLM refuses it too)."""
    if priority != 0 and engine.config.scheduler.policy != "priority":
        raise APIError(
            f"priority {priority} needs a server started with --scheduling-policy priority; this "
            f"one schedules {engine.config.scheduler.policy}",
            param="priority",
        )


def constraint_param(request: Any, plan: ToolPlan | None = None) -> str:
    """The request field a request's structured-output constraint came from: what a 400 about
    it names."""
    if plan is not None and plan.mode in ("named", "required"):
        return "tool_choice"
    response_format = getattr(request, "response_format", None)
    if isinstance(response_format, dict) and response_format.get("type") != "text":
        return "response_format"
    return "structured_outputs"


def request_error(error: RequestError, constraint: str) -> APIError:
    """A request the engine ended for its own fault (its constraint admits no token) as a 400
    naming the field at fault: ``constraint`` (the field the constraint came from) where the
    engine blames the constraint itself, else the field it names (allowed_token_ids,
    bad_words, min_tokens)."""
    param = constraint if error.param == "structured_outputs" else error.param
    return APIError(error.message, 400, param)


class _Choice:
    """What has been sent of one streamed choice so far (its outputs are deltas)."""

    def __init__(self) -> None:
        # The next generated token's logprobs text_offset: as unstreamed, the echoed prompt's
        # length, then each token's text length (a chunk's text may be shorter: a character's
        # first bytes or a stop string's possible start are held back).
        self.text_offset = 0
        self.num_tokens = 0
        self.chunks_sent = 0

    def advance(self, delta: CompletionOutput) -> None:
        self.num_tokens += len(delta.token_ids)


def _worth_a_chunk(delta: CompletionOutput) -> bool:
    """A chunk goes out when it carries new tokens, text, logprobs the client asked for, or the
    end; not for a step that produced nothing for this choice. A token whose text is still empty
    (the first bytes of a character, or a model served without a tokenizer) gets its chunk, as in
    vLLM: clients time tokens by chunks."""
    return bool(delta.token_ids or delta.text or delta.logprobs or delta.finish_reason is not None)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several prompts' output streams as (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
            raise
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(payload: Any) -> str:
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


async def _sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending in ``[DONE]``; an error after the stream began becomes an error
    event, which the openai client raises."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield _sse(error_body(e.message, e.status, e.param))
    except Exception as e:
        yield _sse(error_body(str(e), error_status(e)))
    yield "data: [DONE]\n\n"


def error_status(error: Exception) -> int:
    """The status of an error raised after a stream began: 503 when the engine is down, 400 for
    the request's fault, 500 for the server's."""
    if isinstance(error, APIError):
        return error.status
    if isinstance(error, EngineDeadError):
        return 503
    return 400 if isinstance(error, ValueError) else 500


class Completions:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _prompts(self, request: CompletionRequest) -> list[Any]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        elif isinstance(prompt[0], int):
            return [prompt]
        else:
            prompts = list(prompt)
        if request.add_special_tokens or self.engine.tokenizer is None:
            return prompts
        # Text tokenized here, without the special tokens the engine's encoding adds (it was
        # ignored: a BOS was added all the same).
        return [
            {
                "prompt": p,
                "prompt_token_ids": encode_text(self.engine.tokenizer, p, add_special_tokens=False),
            }
            if isinstance(p, str)
            else p
            for p in prompts
        ]

    async def create(
        self, request: CompletionRequest, arrival_time: float | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        if request.best_of is not None and request.best_of > 1:
            raise APIError("best_of > 1 is not supported", param="best_of")
        if request.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        check_priority(self.engine, request.priority)
        params = sampling_params(self.engine, request, request.max_tokens, 16, request.logprobs)
        if request.echo and request.logprobs is not None and params.prompt_logprobs != -1:
            # The echoed prompt's tokens get logprobs too (vLLM's echo): its top `logprobs`.
            wanted = max(params.prompt_logprobs or 0, request.logprobs)
            params = dataclasses.replace(params, prompt_logprobs=wanted)
        request_id = random_id("cmpl")
        prompts = self._prompts(request)
        kind = "delta" if request.stream else "final"
        streams = [
            self.engine.generate(
                prompt,
                params,
                f"{request_id}-{i}",
                request.priority,
                kind,
                arrival_time,
                max_tokens_field=None if request.max_tokens is None else "max_tokens",
            )
            for i, prompt in enumerate(prompts)
        ]
        # Start (and so validate) every prompt before answering: a bad one is a 400, not a stream.
        constraint = constraint_param(request)
        firsts = await _start_all(streams, not request.stream, constraint)
        events = _merge(
            [_chain(first, stream, constraint) for first, stream in zip(firsts, streams)]
        )
        if request.stream:
            return _sse_stream(self._stream(request, request_id, events, len(prompts)))
        return await self._collect(request, request_id, events, len(prompts))

    def _choice_index(self, request: CompletionRequest, prompt_index: int, index: int) -> int:
        return prompt_index * request.n + index

    def _echo(self, request: CompletionRequest, out: RequestOutput) -> str:
        if not request.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.engine.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(
        self, request: CompletionRequest, out: RequestOutput, echo: str, generated: Any
    ) -> CompletionLogprobs | None:
        """A choice's logprobs: the generated tokens', after the echoed prompt's with echo."""
        if request.logprobs is None:
            return None
        result = _completion_logprobs(generated, len(echo))
        if not echo:
            return result
        prompt = self._echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, request.logprobs)
        return CompletionLogprobs(
            text_offset=prompt.text_offset + result.text_offset,
            token_logprobs=prompt.token_logprobs + result.token_logprobs,
            tokens=prompt.tokens + result.tokens,
            top_logprobs=prompt.top_logprobs + result.top_logprobs,
        )

    def _echo_logprobs(self, token_ids: list[int], entries: Any, top: int) -> CompletionLogprobs:
        """The echoed prompt's tokens with their logprobs and top ``top`` (the first token has
        none: nothing predicts it), offsets from the start of the text, as vLLM gives them."""
        result = CompletionLogprobs()
        offset = 0
        entries = entries or [None] * len(token_ids)
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry is None:
                text, logprob, tops = self.engine.tokenizer.decode([token_id]), None, None
            else:
                chosen = entry[token_id]
                text, logprob = _token_text(token_id, chosen), chosen.logprob
                ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)[:top]
                tops = {_token_text(t, lp): lp.logprob for t, lp in [(token_id, chosen), *ranked]}
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(tops)
            result.text_offset.append(offset)
            offset += len(text)
        return result

    async def _collect(
        self, request: CompletionRequest, request_id: str, events: AsyncIterator, num_prompts: int
    ) -> CompletionResponse:
        finals: dict[int, tuple[RequestOutput, CompletionOutput]] = {}
        prompt_tokens: dict[int, int] = {}
        async for i, out in events:
            prompt_tokens[i] = len(out.prompt_token_ids)
            for completion in out.outputs:
                finals[self._choice_index(request, i, completion.index)] = (out, completion)
        choices = []
        for index in sorted(finals):
            out, completion = finals[index]
            echo = self._echo(request, out)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + completion.text,
                    logprobs=self._logprobs(request, out, echo, completion.logprobs),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=_prompt_logprobs(out.prompt_logprobs)
                    if request.prompt_logprobs is not None
                    else None,
                )
            )
        return CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=_usage(prompt_tokens, finals),
        )

    async def _stream(
        self, request: CompletionRequest, request_id: str, events: AsyncIterator, num_prompts: int
    ) -> AsyncIterator[str]:
        sent: dict[int, _Choice] = {}
        prompt_tokens: dict[int, int] = {}
        # Each prompt's logprobs come once, on its stream's first output: kept for the echo of
        # every choice of that prompt.
        prompt_logprobs: dict[int, Any] = {}
        continuous = request.stream_options is not None and request.stream_options.continuous

        def event(chunk: CompletionResponse, i: int, choice: _Choice) -> str:
            if continuous:
                chunk.usage = _choice_usage(prompt_tokens[i], choice)
            return _sse(chunk)

        async for i, out in events:
            prompt_tokens[i] = len(out.prompt_token_ids)
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for delta in out.outputs:
                index = self._choice_index(request, i, delta.index)
                choice = sent.get(index)
                if choice is None:
                    choice = sent[index] = _Choice()
                    echo = self._echo(request, out)
                    if echo:
                        echo_logprobs = None
                        if request.logprobs is not None:
                            echo_logprobs = self._echo_logprobs(
                                out.prompt_token_ids, prompt_logprobs.get(i), request.logprobs
                            )
                        yield event(
                            self._chunk(request_id, index, echo, echo_logprobs, None), i, choice
                        )
                        # The generated text's offsets follow the echoed prompt's, as they do
                        # unstreamed (they restarted at 0).
                        choice.text_offset = len(echo)
                choice.advance(delta)
                if not _worth_a_chunk(delta):
                    continue
                chunk_logprobs = None
                if request.logprobs is not None:
                    chunk_logprobs = _completion_logprobs(delta.logprobs, choice.text_offset)
                    choice.text_offset += sum(len(token) for token in chunk_logprobs.tokens)
                yield event(
                    self._chunk(request_id, index, delta.text, chunk_logprobs, delta), i, choice
                )
        if request.stream_options and request.stream_options.include_usage:
            usage = _stream_usage(prompt_tokens, sent)
            yield _sse(
                CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage)
            )

    def _chunk(
        self,
        request_id: str,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None,
        completion: CompletionOutput | None,
    ) -> CompletionResponse:
        finish = completion.finish_reason if completion is not None else None
        return CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=completion.stop_reason if finish else None,
                )
            ],
        )


class ChatCompletions:
    def __init__(
        self,
        engine: AsyncLLM,
        model_name: str,
        chat_template: str | None,
        tool_options: ToolOptions | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.tool_options = tool_options or ToolOptions()
        self.trust_request_chat_template = trust_request_chat_template
        self.token_bytes = TokenBytes(engine.tokenizer)

    def prompt(self, request: Any, tools: list[FunctionTool] | None = None) -> dict[str, Any]:
        """The rendered prompt; ``tools`` (default: the request's, unchecked by tool_choice)
        reach the template as its ``tools``."""
        if tools is None:
            tools = parse_tools(getattr(request, "tools", None))
        kwargs = dict(request.chat_template_kwargs or {})
        taken = sorted(_REQUEST_TEMPLATE_KWARGS.intersection(kwargs))
        if taken:
            # The template gets these from the request's own fields; as kwargs they clashed with
            # them inside transformers (a TypeError, a 500).
            raise APIError(
                f"chat_template_kwargs may not set {', '.join(taken)}: they come from the "
                "request's messages and tools",
                param="chat_template_kwargs",
            )
        if tools:
            kwargs["tools"] = [tool.as_openai() for tool in tools]
        request_template = getattr(request, "chat_template", None)
        if request_template is not None and not self.trust_request_chat_template:
            # As vLLM: a template is code the server runs; only its operator may allow clients'.
            raise APIError(
                "this server does not run chat templates sent with requests; its operator can "
                "allow them with --trust-request-chat-template",
                param="chat_template",
            )
        try:
            return self.engine.apply_chat_template(
                template_messages([m.model_dump(exclude_none=True) for m in request.messages]),
                chat_template=request_template or self.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=kwargs,
            )
        except (ValueError, APIError):
            raise
        except Exception as e:
            # A template of the request's own, or the model's given the request's template
            # arguments, that fails in Python rather than in jinja ({{ 1 / 0 }}, a document that
            # is not a dict): the request's fault, not the server's.
            if request_template is None and not request.chat_template_kwargs:
                raise
            raise APIError(
                f"the chat template failed with this request's "
                f"{'chat_template' if request_template else 'chat_template_kwargs'}: "
                f"{type(e).__name__}: {e}",
                param="chat_template" if request_template else "chat_template_kwargs",
            ) from None

    async def create(
        self, request: ChatCompletionRequest, arrival_time: float | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        tools = parse_tools(request.tools)
        plan = plan_tools(
            tools,
            request.tool_choice,
            request.parallel_tool_calls,
            self.tool_options.enable_auto_tool_choice,
            self.tool_options.tool_call_parser,
        )
        if request.top_logprobs and not request.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        check_priority(self.engine, request.priority)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens or request.max_tokens
        field = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        params = sampling_params(self.engine, request, max_tokens, None, logprobs)
        apply_tool_plan(params, plan)
        prompt = self.prompt(request, tools)
        request_id = random_id("chatcmpl")
        kind = "delta" if request.stream else "final"
        stream = self.engine.generate(
            prompt,
            params,
            request_id,
            request.priority,
            kind,
            arrival_time,
            max_tokens_field=None if max_tokens is None else field,
        )
        constraint = constraint_param(request, plan)
        (first,) = await _start_all([stream], not request.stream, constraint)
        events = _chain(first, stream, constraint)
        top = request.top_logprobs or 0
        parsers = _ParserFactory(self.engine, plan, prompt.get("prompt"))
        if request.stream:
            return _sse_stream(self._stream(request, request_id, events, top, parsers))
        return await self._collect(request, request_id, events, top, parsers)

    async def _collect(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        events: AsyncIterator,
        top: int,
        parsers: _ParserFactory,
    ) -> ChatCompletionResponse:
        finals: dict[int, tuple[RequestOutput, CompletionOutput]] = {}
        num_prompt_tokens = 0
        async for out in events:
            num_prompt_tokens = len(out.prompt_token_ids)
            for completion in out.outputs:
                finals[completion.index] = (out, completion)
        choices = []
        for index, (_, completion) in sorted(finals.items()):
            message = parsers.new().parse(completion.text)
            tool_calls = [
                ToolCall(
                    id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)
                )
                for call in message.tool_calls
            ]
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(
                        content=message.content,
                        reasoning_content=message.reasoning,
                        tool_calls=tool_calls,
                    ),
                    logprobs=_chat_logprobs(completion.logprobs, top, self.token_bytes)
                    if request.logprobs
                    else None,
                    finish_reason=_finish_reason(completion.finish_reason, bool(tool_calls)),
                    stop_reason=completion.stop_reason,
                )
            )
        usage = _usage({0: num_prompt_tokens}, finals)
        prompt_logprobs = None
        if request.prompt_logprobs is not None and finals:
            prompt_logprobs = _prompt_logprobs(next(iter(finals.values()))[0].prompt_logprobs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        events: AsyncIterator,
        top: int,
        parsers: _ParserFactory,
    ) -> AsyncIterator[str]:
        sent: dict[int, _Choice] = {}
        choice_parsers: dict[int, OutputParser] = {}
        num_prompt_tokens = 0

        continuous = request.stream_options is not None and request.stream_options.continuous

        def chunk(choice: ChatStreamChoice, sent_so_far: _Choice) -> str:
            usage = _choice_usage(num_prompt_tokens, sent_so_far) if continuous else None
            return _sse(
                ChatCompletionChunk(
                    id=request_id, model=self.model_name, choices=[choice], usage=usage
                )
            )

        async for out in events:
            num_prompt_tokens = len(out.prompt_token_ids)
            for delta in out.outputs:
                choice = sent.setdefault(delta.index, _Choice())
                choice.advance(delta)
                parser = choice_parsers.setdefault(delta.index, parsers.new())
                finish = delta.finish_reason
                if parser.active:
                    parsed = parser.feed(delta.text)
                    if finish is not None:
                        end = parser.finish()
                        parsed.reasoning += end.reasoning
                        parsed.content += end.content
                        parsed.tool_calls += end.tool_calls
                    # A step whose text the parsers hold back (a marker perhaps starting) has
                    # nothing to say yet, unless it carries logprobs or the end.
                    if not (parsed or finish is not None or (delta.logprobs and request.logprobs)):
                        continue
                    message = DeltaMessage(
                        content=parsed.content or None,
                        reasoning_content=parsed.reasoning or None,
                        tool_calls=parsed.tool_calls or None,
                    )
                    if finish is not None:
                        finish = _finish_reason(finish, bool(parser.streamed_calls))
                elif _worth_a_chunk(delta):
                    message = DeltaMessage(content=delta.text)
                else:
                    continue
                # The role rides on the choice's first chunk rather than in an empty one.
                if choice.chunks_sent == 0:
                    message.role = "assistant"
                choice.chunks_sent += 1
                yield chunk(
                    ChatStreamChoice(
                        index=delta.index,
                        delta=message,
                        logprobs=_chat_logprobs(delta.logprobs, top, self.token_bytes)
                        if request.logprobs
                        else None,
                        finish_reason=finish,
                        stop_reason=delta.stop_reason if finish else None,
                    ),
                    choice,
                )
        if request.stream_options and request.stream_options.include_usage:
            usage = _stream_usage({0: num_prompt_tokens}, sent)
            yield _sse(
                ChatCompletionChunk(id=request_id, model=self.model_name, choices=[], usage=usage)
            )


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """A reply that ends in tool calls finishes with "tool_calls" (one cut short by max_tokens
    still says "length")."""
    return "tool_calls" if called_tools and reason == "stop" else reason


class _ParserFactory:
    """Makes each choice's OutputParser (they hold per-choice stream state)."""

    def __init__(self, engine: AsyncLLM, plan: ToolPlan, prompt: str | None) -> None:
        self.engine, self.plan, self.prompt = engine, plan, prompt

    def new(self) -> OutputParser:
        return output_parser(self.engine, self.plan, self.prompt)


async def _start_all(
    streams: list[AsyncIterator[RequestOutput]],
    wait_for_output: bool = True,
    constraint: str = "structured_outputs",
) -> list[asyncio.Task[RequestOutput]]:
    """Start each stream's first output: this validates and queues every prompt, and raises
    (after aborting the others) when one is invalid. With ``wait_for_output`` it returns once
    every first output is there (an answer whose status depends on them: an engine core that
    refuses a request is a 500); without, as soon as every prompt is validated and queued, so
    that a stream's headers go out while its prompt is computed and its first token travels the
    same short path as the others (awaited here, the first chunk went out behind the headers and
    the response machinery: at 16 req/s on the H200 the client's TTFT ran 7.2 ms above the
    server's histogram, 6.0 ms with this). A refusal then ends the stream with an error event.
    A request the engine ended for its own fault is a 400 naming the field at fault
    (``request_error``; ``constraint``: the field its constraint came from)."""
    tasks = [asyncio.ensure_future(anext(stream)) for stream in streams]
    try:
        if wait_for_output:
            await asyncio.gather(*tasks)
        else:
            # One turn of the loop runs each task to its first await: AsyncLLM.generate validates
            # and queues the request before it awaits anything, so a task still pending has
            # been accepted and one that is done either failed validation or already finished.
            await asyncio.sleep(0)
            for task in tasks:
                if task.done():
                    task.result()  # raises what validation raised
        return tasks
    except BaseException as e:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        if isinstance(e, RequestError):
            raise request_error(e, constraint) from None
        raise


async def _chain(
    first: asyncio.Task[RequestOutput],
    rest: AsyncIterator[RequestOutput],
    constraint: str = "structured_outputs",
) -> AsyncIterator:
    """The stream's first output (from its _start_all task), then the rest of it; a request the
    engine ended for its own fault raises a 400 (``request_error``), which a stream sends as its
    error event."""
    try:
        out = await first
        yield out
        if out.finished:
            return
        async for out in rest:
            yield out
    except RequestError as e:
        raise request_error(e, constraint) from None
    finally:
        if not first.done():  # the client left before the first token: the task holds `rest`
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        await rest.aclose()


def _usage(
    prompt_tokens: dict[int, int], finals: dict[int, tuple[Any, CompletionOutput | None]]
) -> Usage:
    completion_tokens = sum(len(c.token_ids) for _, c in finals.values() if c is not None)
    prompt = sum(prompt_tokens.values())
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
    )


def _choice_usage(prompt_tokens: int, choice: _Choice) -> Usage:
    """A chunk's usage with ``continuous_usage_stats`` (as vLLM): its prompt's tokens and its
    choice's tokens so far."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=choice.num_tokens,
        total_tokens=prompt_tokens + choice.num_tokens,
    )


def _stream_usage(prompt_tokens: dict[int, int], sent: dict[int, _Choice]) -> Usage:
    completion_tokens = sum(choice.num_tokens for choice in sent.values())
    prompt = sum(prompt_tokens.values())
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
    )


def _prompt_logprobs(entries: Any) -> PromptLogprobs | None:
    """RequestOutput.prompt_logprobs as the response carries them (vLLM's shape)."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            token_id: PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


def _token_text(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _completion_logprobs(
    logprobs: list[dict[int, Logprob]] | None, text_offset: int
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for entry in logprobs or []:
        token_id, chosen = next(iter(entry.items()))  # the sampled token comes first
        text = _token_text(token_id, chosen)
        result.tokens.append(text)
        result.token_logprobs.append(chosen.logprob)
        result.top_logprobs.append({_token_text(t, lp): lp.logprob for t, lp in entry.items()})
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def _chat_logprobs(
    logprobs: list[dict[int, Logprob]] | None, top: int, token_bytes: TokenBytes
) -> ChatLogprobs:
    content = []
    for entry in logprobs or []:
        token_id, chosen = next(iter(entry.items()))
        ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)[:top]
        content.append(
            ChatTokenLogprob(
                **_top(token_id, chosen, token_bytes).model_dump(),
                top_logprobs=[_top(t, lp, token_bytes) for t, lp in ranked],
            )
        )
    return ChatLogprobs(content=content)


def _top(token_id: int, logprob: Logprob, token_bytes: TokenBytes) -> TopLogprob:
    text = _token_text(token_id, logprob)
    return TopLogprob(token=text, logprob=logprob.logprob, bytes=token_bytes(token_id, text))
