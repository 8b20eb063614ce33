"""The schedule as ranks in other processes receive it: only what is new crosses, and each rank
rebuilds the SchedulerOutput the engine core's scheduler made."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvik.executor.schedule_wire import RankRequests, ScheduleSender, StepMessage
from kvik.request import Request
from kvik.sampling_params import SamplingParams, StructuredOutputsParams
from kvik.scheduler.output import ScheduledRequest, SchedulerOutput
from kvik.structured_output.manager import GrammarBitmask

_decoder = msgspec.msgpack.Decoder(StepMessage)


def cross(sender: ScheduleSender, rank: RankRequests, out: SchedulerOutput):
    """Encode on the core's side, decode and rebuild on a rank's; also the message itself."""
    message = _decoder.decode(msgspec.msgpack.encode(sender.message(out)))
    return message, rank.scheduler_output(message)


def assert_same(rebuilt: SchedulerOutput, original: SchedulerOutput) -> None:
    assert rebuilt.total_num_scheduled_tokens == original.total_num_scheduled_tokens
    assert rebuilt.finished_req_ids == original.finished_req_ids
    assert rebuilt.preempted_req_ids == original.preempted_req_ids
    for got, want in zip(rebuilt.scheduled, original.scheduled, strict=True):
        for field in ("start", "num_tokens", "block_ids", "samples", "num_placeholder_tokens"):
            assert getattr(got, field) == getattr(want, field), field
        g, w = got.request, want.request
        assert g.request_id == w.request_id and g.all_token_ids == w.all_token_ids
        assert g.output_token_ids == w.output_token_ids and g.num_preemptions == w.num_preemptions
        assert g.sampling_params == w.sampling_params and g.eos_token_ids == w.eos_token_ids
        assert g.bad_words_token_ids == w.bad_words_token_ids


def test_only_new_tokens_and_blocks_cross_and_preemption_resends_the_blocks():
    params = SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.2, seed=3)
    a = Request("a", [1, 2, 3, 4, 5], params, 8, frozenset({2}), bad_words_token_ids=[[9, 9]])
    b = Request("b", [7, 8], SamplingParams(temperature=0.0), 4)
    sender, rank = ScheduleSender(), RankRequests()

    first = SchedulerOutput([ScheduledRequest(a, 0, 5, [4, 6], True)], 5)
    message, rebuilt = cross(sender, rank, first)
    assert [r.request_id for r in message.new_requests] == ["a"]
    assert_same(rebuilt, first)

    a.append_output_token(11)
    second = SchedulerOutput(
        [ScheduledRequest(a, 5, 1, [4, 6], True), ScheduledRequest(b, 0, 2, [1], True)], 3
    )
    message, rebuilt = cross(sender, rank, second)
    assert [r.request_id for r in message.new_requests] == ["b"]
    delta = message.scheduled[0]
    assert delta.new_token_ids == [11] and delta.new_block_ids == []  # a's prompt does not cross
    assert_same(rebuilt, second)
    assert rebuilt.scheduled[0].request is rank._requests["a"]  # one mirror for the request's life

    # a is preempted (its blocks freed) and readmitted with other blocks; b finished.
    a.append_output_token(12)
    a.num_preemptions = 1
    third = SchedulerOutput(
        [ScheduledRequest(a, 0, 7, [2, 3], True, num_placeholder_tokens=0)],
        7,
        finished_req_ids={"b"},
        preempted_req_ids={"a"},
    )
    message, rebuilt = cross(sender, rank, third)
    assert message.scheduled[0].new_block_ids == [2, 3] and message.scheduled[0].new_token_ids == [
        12
    ]
    assert_same(rebuilt, third)
    assert "b" not in rank._requests

    # An asynchronous step: one token in flight, not sent (the rank reads it on its device).
    a.num_output_placeholders = 1
    fourth = SchedulerOutput([ScheduledRequest(a, 7, 1, [2, 3, 5], True, 1)], 1)
    message, rebuilt = cross(sender, rank, fourth)
    assert message.scheduled[0].new_token_ids == [] and message.scheduled[0].new_block_ids == [5]
    assert_same(rebuilt, fourth)


def test_a_request_the_rank_never_received_is_an_error():
    a = Request("a", [1, 2], SamplingParams(), 4)
    sender = ScheduleSender()
    sender.message(SchedulerOutput([ScheduledRequest(a, 0, 2, [0], True)], 2))
    late_rank = RankRequests()  # missed the step that carried the request
    step = sender.message(SchedulerOutput([ScheduledRequest(a, 2, 1, [0], True)], 1))
    with pytest.raises(
        RuntimeError, match="request a is scheduled on this rank but was never sent"
    ):
        late_rank.scheduler_output(step)


def test_grammar_masks_and_structured_params_reach_the_rank() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    request = Request(
        request_id="r0", prompt_token_ids=[1, 2, 3], sampling_params=params, max_tokens=8,
        eos_token_ids=frozenset({0}),
    )  # fmt: skip
    output = SchedulerOutput([ScheduledRequest(request, 0, 3, [7], True, 0)], 3)
    words = torch.randint(-(2**31), 2**31 - 1, (1, 5), dtype=torch.int32)
    output.grammar_bitmask = GrammarBitmask(["r0"], words)

    wire = msgspec.msgpack.encode(ScheduleSender().message(output))
    mirrored = RankRequests().scheduler_output(msgspec.msgpack.decode(wire, type=StepMessage))

    assert mirrored.grammar_bitmask.request_ids == ["r0"]
    assert torch.equal(mirrored.grammar_bitmask.bitmask, words)
    (scheduled,) = mirrored.scheduled
    assert scheduled.request.sampling_params.structured_outputs.regex == "[ab]+"
    # A step without grammars sends none.
    plain = SchedulerOutput([], 0)
    wire = msgspec.msgpack.encode(ScheduleSender().message(plain))
    assert (
        RankRequests()
        .scheduler_output(msgspec.msgpack.decode(wire, type=StepMessage))
        .grammar_bitmask
        is None
    )
