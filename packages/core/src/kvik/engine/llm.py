"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as vLLM's."""

from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvik.engine.args import EngineArgs
from kvik.engine.core import EngineCore
from kvik.engine.input_processor import (
    InputProcessor,
    PromptType,
    check_priority,
    child_requests,
)
from kvik.engine.options import option_specs
from kvik.engine.output_processor import OutputProcessor, RequestState
from kvik.outputs import RequestError, RequestOutput
from kvik.sampling_params import SamplingParams
from kvik.scheduler.output import SchedulerStats


class LLM:
    """An engine in this process, for offline batches of prompts.

    ``model`` is a Hugging Face folder, a .gguf file, a hub id or an alias; None means the default
    model, SmolLM2-135M-Instruct. The other keywords are the engine's options, exactly the fields
    of ``kvik.engine.args.EngineArgs`` (each with its help text there, and as a flag in
    ``kvik generate --help``): ``LLM(max_num_seqs=8, enforce_eager=True)``. An unknown keyword is
    a TypeError that names the closest option.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineArgs.from_options(
            caller="LLM()", model=model, **options
        ).create_engine_config()
        self.input_processor = InputProcessor(self.config.model)
        self.output_processor = OutputProcessor(self.input_processor.tokenizer)
        self.engine = EngineCore(self.config)
        # The engine's rank processes (``mp``) end with this object, or at the latest with the
        # interpreter; ``shutdown()`` ends them now.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine (its rank processes, if any); the LLM cannot generate afterwards."""
        self._finalizer()

    @property
    def stats(self) -> SchedulerStats:
        """Engine statistics: prefix-cache queries and hits (tokens), preemptions, chunks, steps."""
        return self.engine.scheduler.stats

    def get_tokenizer(self):
        return self.input_processor.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults, as vLLM does (those
        the ``generation_config`` option chose)."""
        return SamplingParams.from_generation_config(self.config.model.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = self.input_processor.as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif not isinstance(sampling_params, Sequence):
            raise ValueError(
                "sampling_params must be SamplingParams or a list of them, one a prompt, got "
                f"{type(sampling_params).__name__}"
            )
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        if priority is not None and not isinstance(priority, Sequence):
            raise ValueError(
                f"priority must be a list of ints, one a prompt, got {type(priority).__name__}"
            )
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        for prio in priorities:
            check_priority(prio)
        if any(priorities) and self.config.scheduler.policy != "priority":
            # As vLLM: under fcfs a priority would be silently ignored.
            raise ValueError(
                f"priority {next(p for p in priorities if p)} needs an LLM made with "
                f"scheduling_policy='priority'; this one schedules by "
                f"{self.config.scheduler.policy!r}"
            )
        # Validate every prompt before adding any, so a bad one leaves the engine untouched.
        processed = [
            self.input_processor.process(prompt, params)
            for prompt, params in zip(prompt_list, params_list)
        ]
        results: list[RequestOutput] = []
        states = []
        now = time.monotonic()
        try:
            for (prompt_text, token_ids, params), prio in zip(processed, priorities):
                parent_id = str(next(self._ids))
                results.append(RequestOutput(parent_id, prompt_text, token_ids))
                for index, (child_id, child_params) in enumerate(child_requests(parent_id, params)):
                    request = self.input_processor.make_request(
                        child_id, token_ids, child_params, prio, now
                    )
                    states.append(
                        self.output_processor.add_request(
                            child_id,
                            prompt_text,
                            token_ids,
                            child_params,
                            index,
                            request.stop_token_set(),
                        )
                    )
                    self.engine.add_request(request)
            self._run_to_completion(len(states), use_tqdm)
        except BaseException:
            # An error or Ctrl-C mid-batch: abort this call's requests, so that they neither hold
            # KV blocks nor run on in the next call.
            self._abort([state.request_id for state in states])
            raise
        prompt_index = -1
        failed = []
        for state in states:
            if state.index == 0:
                prompt_index += 1
                result = results[prompt_index]
                result.prompt_logprobs = state.prompt_logprobs
                result.finished = True
            result.num_cached_tokens = max(result.num_cached_tokens, state.num_cached_tokens)
            result.outputs.append(state.completion())
            if state.finish_reason == "error":
                failed.append((prompt_index, state))
        if failed:
            # Raised once the whole batch has finished: the other requests ran to their end.
            raise _request_error(failed, results)
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several."""
        if not isinstance(messages, list):
            raise ValueError(
                "messages must be a conversation (a list of message dicts) or a list of them, got "
                f"{type(messages).__name__}"
            )
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.input_processor.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams) -> Iterator[str]:
        """Generate for one prompt, yielding text as soon as it is final (``kvik chat`` uses it)."""
        text, token_ids, params = self.input_processor.process(prompt, sampling_params)
        if params.n != 1:
            raise ValueError("stream() generates one completion: n must be 1")
        request_id = str(next(self._ids))
        request = self.input_processor.make_request(
            request_id, token_ids, params, 0, time.monotonic()
        )
        state = self.output_processor.add_request(
            request_id, text, token_ids, params, stop_token_ids=request.stop_token_set()
        )
        self.engine.add_request(request)
        sent = 0
        try:
            while not state.finished:
                # A step at a time: the caller runs between yields.
                with full_collections_deferred():
                    _, to_abort = self.output_processor.process_outputs(self.engine.step())
                if to_abort:
                    self.engine.abort_requests(to_abort)
                if state.finish_reason == "error":
                    raise RequestError(str(state.stop_reason), state.error_param)
                ready = state.streamable_text_len()
                if ready > sent:
                    yield state.text[sent:ready]
                    sent = ready
        finally:
            if not state.finished:  # the caller stopped early: free the request's blocks
                self.output_processor.abort(request_id)
                self.engine.abort_requests([request_id])

    def _abort(self, request_ids: list[str]) -> None:
        unfinished = [
            request_id
            for request_id in request_ids
            if self.output_processor.abort(request_id) is not None
        ]
        if unfinished:
            self.engine.abort_requests(unfinished)

    def _run_to_completion(self, num_requests: int, use_tqdm: bool) -> None:
        with (
            tqdm(total=num_requests, desc="generating", disable=not use_tqdm, unit="req") as bar,
            full_collections_deferred(),
        ):
            while self.engine.has_unfinished_requests():
                changed, to_abort = self.output_processor.process_outputs(self.engine.step())
                if to_abort:
                    self.engine.abort_requests(to_abort)
                bar.update(sum(state.finished for state in changed))


def _request_error(
    failed: list[tuple[int, RequestState]], results: list[RequestOutput]
) -> RequestError:
    """The error of a batch whose requests (prompt index, state) failed through their own fault,
    raised once every request of the batch has finished: the first one's reason, a count of
    the others, and every output (``RequestError.outputs``)."""
    index, state = failed[0]
    message = f"prompt {index}: {state.stop_reason}"
    if len(failed) > 1:
        others = ", ".join(str(i) for i in sorted({i for i, _ in failed[1:]}))
        message += f"; {len(failed) - 1} more failed (prompts {others}): see the error's outputs"
    return RequestError(message, state.error_param, results)


class _Deferral:
    """The calls deferring full collections now (threads may overlap), and the collector's
    thresholds the last of them puts back."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved_threshold: tuple[int, int, int] | None = None


_deferral = _Deferral()

#: A full-collection threshold never reached: the oldest generation's counter climbs by one for
#: every collection of the middle one.
_NEVER = 2**31 - 1


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """No automatic full collection of the process's heap while the engine steps; young
    collections go on, and the collector's thresholds are put back when the last overlapping
    call ends.

    A full collection walks every tracked object: with torch, transformers and a compiled model
    loaded that is about a million, a pause of 0.3-0.5 s that the H200 showed in the middle of a
    batch's decoding (twice in one 1,029-step run of workload B, 5% of its time). The engine's
    own process and the server freeze their start-up for good (``gc.freeze()``); an LLM shares
    its process with its caller, whose garbage must stay collectable, so it freezes nothing.
    (It used to freeze the heap while it stepped. Where something else had frozen objects first,
    as on the H200, that freeze was left in place, unfreezing being all or nothing, and whatever
    was alive then stayed uncollectable for good: a pytest process grew by each LLM made after an
    in-process server's freeze, its KV cache included, until CI ran out of memory. And a thaw
    put the whole heap in the oldest generation, where dropped LLMs waited long for a full
    collection.) The steps themselves leave no cyclic garbage (0 objects found unreachable after
    32 x 256 tokens on the CPU), so nothing piles up while collections wait."""
    if not gc.isenabled():
        yield
        return
    with _deferral.lock:
        if _deferral.depth == 0:
            _deferral.saved_threshold = gc.get_threshold()
            gc.set_threshold(_deferral.saved_threshold[0], _deferral.saved_threshold[1], _NEVER)
        _deferral.depth += 1
    try:
        yield
    finally:
        with _deferral.lock:
            _deferral.depth -= 1
            if _deferral.depth == 0 and _deferral.saved_threshold is not None:
                gc.set_threshold(*_deferral.saved_threshold)


def _signature_from_engine_args() -> inspect.Signature:
    """``LLM.__init__``'s signature as help() and inspect show it: ``model``, then every other
    engine option as a keyword with its default."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", positional), inspect.Parameter("model", positional)]
    for spec in option_specs(EngineArgs):
        if spec.name != "model":
            params.append(
                inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default)
            )
    params[1] = params[1].replace(default=EngineArgs.model)
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _signature_from_engine_args()
