"""AsyncLLM: the asyncio front end of an EngineCore running in its own process.

It validates and tokenizes requests (``InputProcessor``), sends them to the core, and turns the
core's token ids into text and logprobs (``OutputProcessor``) as they arrive, streaming each
request's progress through its own queue. A request whose consumer goes away is aborted in the
core; when the core dies, every request in flight ends with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from kvik.config import EngineConfig
from kvik.engine.args import EngineArgs
from kvik.engine.core_client import EngineCoreClient, EngineDeadError, EngineRequestError
from kvik.engine.core_proc import EngineCoreOutputs
from kvik.engine.input_processor import (
    InputProcessor,
    PromptType,
    check_priority,
    child_requests,
)
from kvik.engine.output_processor import OutputProcessor, RequestState
from kvik.outputs import RequestError, RequestOutput
from kvik.sampling_params import SamplingParams
from kvik.scheduler.output import SchedulerStats

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineRequestError",
    "IterationStats",
    "RequestError",
    "FinishedRequestStats",
    "OutputKind",
    "StatLogger",
]

#: What each RequestOutput of ``AsyncLLM.generate`` holds (vLLM's RequestOutputKind):
#: "cumulative": everything so far; "delta": only what is new since the previous one (no copy of
#: what was sent before, so a long stream costs the same per token throughout); "final": one
#: output, when every completion has finished (its consumer is not woken before).
OutputKind = Literal["cumulative", "delta", "final"]
_OUTPUT_KINDS = ("cumulative", "delta", "final")

logger = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    mean_time_per_output_token: float | None


@dataclass
class IterationStats:
    """What one batch of engine outputs did, in the front end's clock."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration: IterationStats) -> None: ...


@dataclass
class _Timing:
    arrival: float  # time.monotonic(), as Request.arrival_time
    num_prompt_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Stream:
    """One user request: its n engine requests (children) and the queue its consumer reads."""

    output: RequestOutput
    states: list[RequestState]
    kind: OutputKind = "cumulative"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(state.finished for state in self.states)


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None) -> None:
        self.config = config
        self.input_processor = InputProcessor(config.model)
        self.output_processor = OutputProcessor(self.input_processor.tokenizer)
        self.client = EngineCoreClient(config)
        self.client.on_death = self._fail_all
        self.stat_loggers = list(stat_loggers or [])
        self._streams: dict[str, _Stream] = {}
        self._parent_of: dict[str, str] = {}  # child (engine) request id -> user request id
        self._timings: dict[str, _Timing] = {}
        self._output_task: asyncio.Task | None = None
        self._accepting = False

    @classmethod
    async def create(
        cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None
    ) -> AsyncLLM:
        """Resolve the arguments, start the engine core process and wait until it is ready."""
        config = await asyncio.to_thread(args.create_engine_config, serving=True)
        engine = cls(config, stat_loggers)
        await engine.start()
        return engine

    async def start(self) -> None:
        await self.client.start()
        self._output_task = asyncio.create_task(self._output_loop(), name="kvik-outputs")
        self._accepting = True

    @property
    def is_healthy(self) -> bool:
        return self.client.error is None and self._accepting

    @property
    def tokenizer(self) -> Any:
        return self.input_processor.tokenizer

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults under ``overrides``."""
        return SamplingParams.from_generation_config(
            self.config.model.sampling_defaults, **overrides
        )

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> dict:
        return self.input_processor.apply_chat_template(conversation, **kwargs)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        output_kind: OutputKind = "cumulative",
        arrival_time: float | None = None,
        max_tokens_field: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's progress. Each RequestOutput holds the completions that changed
        (text, tokens and logprobs as ``output_kind`` says; text held back while it may still be
        the start of a stop string); the last one has ``finished`` set. Raises ValueError for
        invalid input (RequestError, a ValueError, when the engine ends the request for a fault
        of its own: its constraint admits no token), EngineDeadError when the engine is down and
        EngineRequestError when the engine core could not take this request (it runs on).
        Leaving the iteration early aborts the request. ``arrival_time`` (``time.monotonic()``; default now): when the request
        arrived, e.g. when its HTTP request came in, before its body was read and validated, so
        that the latency metrics count what the client waited for. ``max_tokens_field``: the
        request field ``params.max_tokens`` came from, where a client set it: such a max_tokens
        that the prompt leaves no room for is refused with a ValueError naming the field (the
        OpenAI server's rule, and vLLM's), where otherwise it is cut to the room left."""
        if not self.is_healthy:
            raise self.client.error or EngineDeadError("the engine is shutting down")
        if not isinstance(request_id, str):
            # The core's messages carry ids as strings: any other id would be refused there, with
            # no way back to this request, and its abort would end the core.
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if output_kind not in _OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {_OUTPUT_KINDS}, got {output_kind!r}")
        check_priority(priority)
        if priority and self.config.scheduler.policy != "priority":
            # As LLM.generate and vLLM: under fcfs a priority would be silently ignored.
            raise ValueError(
                f"priority {priority} needs an engine made with scheduling_policy='priority'; "
                f"this one schedules by {self.config.scheduler.policy!r}"
            )
        if arrival_time is not None and (
            not isinstance(arrival_time, int | float)
            or isinstance(arrival_time, bool)
            or not math.isfinite(arrival_time)
        ):
            # A NaN would sort nowhere in the scheduler's queues.
            raise ValueError(
                f"arrival_time must be a finite time.monotonic() value, got {arrival_time!r}"
            )
        prompt_text, token_ids, params = self.input_processor.process(prompt, params)
        if max_tokens_field is not None:
            self.input_processor.check_max_tokens_fit(token_ids, params, max_tokens_field)
        children = child_requests(request_id, params)
        # Build every engine request before sending any, so invalid input leaves nothing behind.
        now = time.monotonic() if arrival_time is None else min(arrival_time, time.monotonic())
        requests = [
            self.input_processor.make_request(child_id, token_ids, child_params, priority, now)
            for child_id, child_params in children
        ]
        stream = _Stream(RequestOutput(request_id, prompt_text, token_ids), [], output_kind)
        self._streams[request_id] = stream
        try:
            for index, ((child_id, child_params), request) in enumerate(zip(children, requests)):
                stream.states.append(
                    self.output_processor.add_request(
                        child_id,
                        prompt_text,
                        token_ids,
                        child_params,
                        index,
                        request.stop_token_set(),
                    )
                )
                self._parent_of[child_id] = request_id
                self._timings[child_id] = _Timing(now, len(token_ids))
                self.client.add_request(request)
            while True:
                changed = await self._next_changes(stream)
                out = self._request_output(stream, changed)
                yield out
                # Decide on what was handed out, not on the stream now: while the consumer held
                # ``out`` the output loop may have finished the request, and its last tokens
                # wait in the queue for the next round.
                if out.finished:
                    return
        finally:
            self.abort(request_id)

    async def _next_changes(self, stream: _Stream) -> list[RequestState]:
        items = [await stream.queue.get()]
        while not stream.queue.empty():
            items.append(stream.queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return list({id(state): state for state in items}.values())

    def _request_output(self, stream: _Stream, changed: list[RequestState]) -> RequestOutput:
        out = replace(stream.output, outputs=[])
        states = stream.states if stream.kind == "final" else changed
        for state in sorted(states, key=lambda s: s.index):
            if stream.kind == "delta":
                completion = state.delta_completion()
            else:
                completion = state.completion()
                completion.text = completion.text[: state.streamable_text_len()]
                if completion.logprobs is not None:  # a snapshot: the state's list keeps growing
                    completion.logprobs = list(completion.logprobs)
            out.outputs.append(completion)
        out.num_cached_tokens = max(state.num_cached_tokens for state in stream.states)
        prompt_logprobs = stream.states[0].prompt_logprobs
        if stream.kind != "delta" or not stream.prompt_logprobs_sent:
            out.prompt_logprobs = prompt_logprobs
            stream.prompt_logprobs_sent = prompt_logprobs is not None
        out.finished = stream.finished
        return out

    def abort(self, request_id: str) -> None:
        """Stop a request: the core frees its blocks. Unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        unfinished = [state.request_id for state in stream.states if not state.finished]
        for child_id in [state.request_id for state in stream.states]:
            self._parent_of.pop(child_id, None)
            self._timings.pop(child_id, None)
        for child_id in unfinished:
            self.output_processor.abort(child_id)
        if unfinished:
            self.client.abort_requests(unfinished)

    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle_outputs(await self.client.get_outputs())
        except EngineDeadError:
            pass  # the client has called _fail_all
        except Exception as e:
            logger.exception("the output loop failed")
            # Nothing reads the core's outputs any more: the engine is dead to its callers, as
            # when the core dies (every request in flight fails, /health says so, and new
            # requests are refused; they were accepted and waited for outputs forever).
            self.client._die(EngineDeadError(f"the front end's output loop failed: {e!r}"))

    def _handle_outputs(self, batch: EngineCoreOutputs) -> None:
        now = time.monotonic()
        iteration = IterationStats()
        for request_id, scheduled in batch.scheduled.items():
            if request_id in self._timings:
                self._timings[request_id].scheduled = scheduled
        changed, to_abort = self.output_processor.process_outputs(batch.outputs)
        if to_abort:
            self.client.abort_requests(to_abort)
        for out in batch.outputs:
            timing = self._timings.get(out.request_id)
            if timing is None or not out.new_token_ids:
                continue
            if timing.first_token is None:
                timing.first_token = now
                iteration.num_prompt_tokens += timing.num_prompt_tokens
                iteration.time_to_first_tokens.append(now - timing.arrival)
            else:
                iteration.inter_token_latencies.append(now - timing.last_token)
            timing.last_token = now
            iteration.num_generation_tokens += len(out.new_token_ids)
        for state in changed:
            parent_id = self._parent_of.get(state.request_id)
            if parent_id is None:
                continue
            stream = self._streams[parent_id]
            if state.finish_reason == "error" and state.error_param is not None:
                # Its own fault (its constraint admits no token): its consumer raises.
                stream.queue.put_nowait(RequestError(str(state.stop_reason), state.error_param))
            elif state.finish_reason == "error":  # the core refused it: its consumer raises
                stream.queue.put_nowait(EngineRequestError(str(state.stop_reason)))
            # A "final" consumer is woken once, when its last completion finishes.
            elif stream.kind != "final" or stream.finished:
                stream.queue.put_nowait(state)
            if state.finished:
                self._parent_of.pop(state.request_id)
                timing = self._timings.pop(state.request_id)
                iteration.finished.append(_finished_stats(state, timing, now))
        for stat_logger in self.stat_loggers:
            stat_logger.record(batch.stats, iteration)

    def _fail_all(self, error: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)

    def end_requests(self, message: str = "the server is shutting down") -> None:
        """Refuse new requests and end those in flight: each consumer raises
        ``EngineDeadError(message)`` and the core frees their blocks. The core keeps running
        until ``shutdown`` (a server whose graceful shutdown ran out of time calls this first, so
        its streams end with an error event rather than a cut connection)."""
        self._accepting = False
        self._fail_all(EngineDeadError(message))
        for request_id in list(self._streams):
            self.abort(request_id)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Refuse new requests, end those in flight with an error, stop and reap the core."""
        self.end_requests()
        if self._output_task is not None:
            self._output_task.cancel()
        await self.client.shutdown(timeout_s)


def _finished_stats(state: RequestState, timing: _Timing, now: float) -> FinishedRequestStats:
    num_tokens = len(state.token_ids)
    decode_time = None
    if num_tokens > 1 and timing.first_token is not None:
        decode_time = (timing.last_token - timing.first_token) / (num_tokens - 1)
    return FinishedRequestStats(
        finish_reason=state.finish_reason,
        num_prompt_tokens=timing.num_prompt_tokens,
        num_generation_tokens=num_tokens,
        e2e_latency=now - timing.arrival,
        queue_time=None
        if timing.scheduled is None
        else max(0.0, timing.scheduled - timing.arrival),
        mean_time_per_output_token=decode_time,
    )
