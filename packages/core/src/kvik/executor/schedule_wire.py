"""A step's schedule as it travels to ranks in other processes, sending only what is new.

The engine core's ``SchedulerOutput`` holds its live ``Request`` objects. A rank in another process
keeps a mirror of every request it runs (``RankRequests``): a request's prompt and settings cross
once, when it is first scheduled; after that each step carries, per scheduled request, only the
tokens that became known since the rank last heard of it and the blocks added since (all of them
again after a preemption). ``ScheduleSender`` tracks what each rank has, so a decode step of R
requests is a few integers per request, encoded once (msgspec msgpack) for every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from kvik.request import Request
from kvik.sampling_params import SamplingParams
from kvik.scheduler.output import ScheduledRequest, SchedulerOutput
from kvik.structured_output.manager import GrammarBitmask


class NewRequest(msgspec.Struct, array_like=True):
    """What a rank needs to mirror a request: fixed for the request's life."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: list[int]
    bad_words_token_ids: list[list[int]]


class ScheduledDelta(msgspec.Struct, array_like=True):
    request_id: str
    start: int
    num_tokens: int
    samples: bool
    num_placeholder_tokens: int
    num_preemptions: int
    #: Known tokens (outputs) appended since the rank last heard of the request.
    new_token_ids: list[int]
    #: Blocks appended since then; after a preemption, the whole list again.
    new_block_ids: list[int]


class GrammarMasks(msgspec.Struct, array_like=True):
    """A step's structured-output masks (``GrammarBitmask``): its int32 words as raw bytes."""

    request_ids: list[str]
    num_words: int
    words: bytes
    rows_per_request: list[int] | None = None


class StepMessage(msgspec.Struct, array_like=True):
    new_requests: list[NewRequest]
    scheduled: list[ScheduledDelta]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    grammar_masks: GrammarMasks | None = None


@dataclass
class _Sent:
    num_tokens: int
    num_blocks: int
    num_preemptions: int


class ScheduleSender:
    """The engine core's side: what every rank already has of each request."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def message(self, scheduler_output: SchedulerOutput) -> StepMessage:
        new_requests: list[NewRequest] = []
        scheduled: list[ScheduledDelta] = []
        for s in scheduler_output.scheduled:
            request = s.request
            sent = self._sent.get(request.request_id)
            if sent is None:
                new_requests.append(_new_request(request))
                sent = self._sent[request.request_id] = _Sent(
                    request.num_prompt_tokens, 0, request.num_preemptions
                )
            if sent.num_preemptions != request.num_preemptions:
                # Its blocks were freed; the ones it holds now start a new list.
                sent.num_blocks, sent.num_preemptions = 0, request.num_preemptions
            known = request.all_token_ids
            scheduled.append(
                ScheduledDelta(
                    request.request_id,
                    s.start,
                    s.num_tokens,
                    s.samples,
                    s.num_placeholder_tokens,
                    request.num_preemptions,
                    known[sent.num_tokens :],
                    s.block_ids[sent.num_blocks :],
                )
            )
            sent.num_tokens, sent.num_blocks = len(known), len(s.block_ids)
        for request_id in scheduler_output.finished_req_ids:
            self._sent.pop(request_id, None)
        return StepMessage(
            new_requests,
            scheduled,
            scheduler_output.total_num_scheduled_tokens,
            sorted(scheduler_output.finished_req_ids),
            sorted(scheduler_output.preempted_req_ids),
            _grammar_masks(scheduler_output.grammar_bitmask),
        )


def _grammar_masks(grammar: GrammarBitmask | None) -> GrammarMasks | None:
    if grammar is None:
        return None
    words = grammar.bitmask.to(torch.int32).contiguous()
    return GrammarMasks(
        list(grammar.request_ids),
        words.shape[1],
        words.numpy().tobytes(),
        grammar.rows_per_request,
    )


def _grammar_bitmask(masks: GrammarMasks | None) -> GrammarBitmask | None:
    if masks is None:
        return None
    words = torch.frombuffer(bytearray(masks.words), dtype=torch.int32)
    return GrammarBitmask(
        masks.request_ids, words.view(-1, masks.num_words), masks.rows_per_request
    )


def _new_request(request: Request) -> NewRequest:
    return NewRequest(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        request.max_tokens,
        sorted(request.eos_token_ids),
        request.bad_words_token_ids,
    )


class RankRequests:
    """A rank's side: mirrors of the requests it runs, rebuilt into ``SchedulerOutput``s."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._blocks: dict[str, list[int]] = {}

    def scheduler_output(self, message: StepMessage) -> SchedulerOutput:
        for new in message.new_requests:
            self._requests[new.request_id] = Request(
                request_id=new.request_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                max_tokens=new.max_tokens,
                eos_token_ids=frozenset(new.eos_token_ids),
                bad_words_token_ids=new.bad_words_token_ids,
            )
            self._blocks[new.request_id] = []
        scheduled = []
        for delta in message.scheduled:
            request = self._requests.get(delta.request_id)
            if request is None:
                raise RuntimeError(
                    f"request {delta.request_id} is scheduled on this rank but was never sent"
                )
            for token in delta.new_token_ids:
                request.append_output_token(token)
            blocks = self._blocks[delta.request_id]
            if delta.num_preemptions != request.num_preemptions:
                request.num_preemptions = delta.num_preemptions
                blocks.clear()
            blocks.extend(delta.new_block_ids)
            scheduled.append(
                ScheduledRequest(
                    request,
                    delta.start,
                    delta.num_tokens,
                    list(blocks),
                    delta.samples,
                    delta.num_placeholder_tokens,
                )
            )
        for request_id in message.finished_req_ids:
            self._requests.pop(request_id, None)
            self._blocks.pop(request_id, None)
        output = SchedulerOutput(
            scheduled,
            message.total_num_scheduled_tokens,
            set(message.finished_req_ids),
            set(message.preempted_req_ids),
        )
        output.grammar_bitmask = _grammar_bitmask(message.grammar_masks)
        return output
