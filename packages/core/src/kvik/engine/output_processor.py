"""The front end's view of each request: text, logprobs and finish state built from engine outputs.

Shared by the offline ``LLM`` and the server's ``AsyncLLM``. The engine core streams token ids; here
they become text incrementally, stop strings end requests (the caller aborts them in the core), and
raw logprobs become vLLM's ``Logprob`` dicts with decoded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvik.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from kvik.outputs import CompletionOutput, Logprob, PromptLogprobs, SampleLogprobs
from kvik.sampling_params import SamplingParams
from kvik.scheduler.output import EngineCoreOutput, TokenLogprobs


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    index: int = 0  # which of the parent's n completions this is
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # A finish "error" that is the request's own fault: the SamplingParams field at fault
    # (EngineCoreOutput.error_param); stop_reason holds the message.
    error_param: str | None = None
    num_cached_tokens: int = 0
    # The tokens whose sampling ended the request (Request.stop_token_set): a "stop" finish on
    # one adds no text; on another token (a grammar complete before min_tokens) the text stays.
    # None: not known, every "stop" finish drops its last token's text.
    stop_token_ids: frozenset[int] | None = None
    # What delta_completion() has handed out so far.
    sent_text_len: int = 0
    sent_num_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def streamable_text_len(self) -> int:
        """How much of ``text`` is final: while unfinished, the tail that could still turn out
        to be the start of a stop string is held back."""
        if self.finished or not self.params.stop or self.params.include_stop_str_in_output:
            return len(self.text)
        hold = max(len(stop) for stop in self.params.stop) - 1
        return max(0, len(self.text) - hold)

    def delta_completion(self) -> CompletionOutput:
        """What is new since the previous call: the streamable text, token ids and logprobs not
        handed out yet (slices of what is new only). The cumulative logprob stays cumulative."""
        end = max(self.sent_text_len, self.streamable_text_len())
        text = self.text[self.sent_text_len : end]
        first = self.sent_num_tokens
        self.sent_text_len, self.sent_num_tokens = end, len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[first:],
            cumulative_logprob=self.cumulative_logprob,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else self.logprobs[first:],
        )

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._decoded: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        stop_token_ids: frozenset[int] | None = None,
    ) -> RequestState:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
        state = RequestState(request_id, prompt, prompt_token_ids, params, detokenizer, index)
        state.stop_token_ids = stop_token_ids
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.requests[request_id] = state
        return state

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestState], list[str]]:
        """Apply engine outputs. Returns the states that changed, and the ids of requests a stop
        string finished, which the caller must abort in the engine core."""
        changed, to_abort = [], []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None or state.finished:
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = [None] + [
                    self._logprob_dict(e) for e in out.prompt_logprobs
                ]
            stopped_by_string = self._append_tokens(state, out)
            if stopped_by_string:
                to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
                state.error_param = out.error_param
            changed.append(state)
            if state.finished:
                del self.requests[out.request_id]
        return changed, to_abort

    def abort(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None and not state.finished:
            state.finish_reason = "abort"
        return state

    def _append_tokens(self, state: RequestState, out: EngineCoreOutput) -> bool:
        params = state.params
        last = len(out.new_token_ids) - 1
        # A stop or EOS token that ends the request adds no text, as in vLLM.
        drop_last = (
            out.finish_reason == "stop"
            and not params.include_stop_str_in_output
            and (
                state.stop_token_ids is None
                or bool(out.new_token_ids)
                and out.new_token_ids[-1] in state.stop_token_ids
            )
        )
        for i, token_id in enumerate(out.new_token_ids):
            state.token_ids.append(token_id)
            if state.logprobs is not None and out.new_logprobs is not None:
                entry = out.new_logprobs[i]
                state.logprobs.append(self._logprob_dict(entry))
                state.cumulative_logprob += entry.logprobs[0]
            if state.detokenizer is None or (i == last and drop_last):
                continue
            chunk = state.detokenizer.step(token_id)
            state.text += chunk
            # As vLLM: stop strings count only once the output is longer than min_tokens (stop
            # and EOS tokens are masked until then).
            if params.stop and chunk and len(state.token_ids) > params.min_tokens:
                found = find_stop_string(
                    state.text, len(chunk), params.stop, params.include_stop_str_in_output
                )
                if found is not None:
                    stop, cut = found
                    state.text = state.text[:cut]
                    state.finish_reason, state.stop_reason = "stop", stop
                    return True
        return False

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        return {
            token_id: Logprob(logprob, rank, self._decode_one(token_id))
            for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
        }

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        if token_id not in self._decoded:
            self._decoded[token_id] = self.tokenizer.decode([token_id])
        return self._decoded[token_id]
