"""A step's schedule on its way to ranks in other processes (kvik.executor.schedule_wire): the
structured-output masks cross with it, word for word."""

from __future__ import annotations

import msgspec
import torch

from kvik.executor.schedule_wire import RankRequests, ScheduleSender, StepMessage
from kvik.request import Request
from kvik.sampling_params import SamplingParams, StructuredOutputsParams
from kvik.scheduler.output import ScheduledRequest, SchedulerOutput
from kvik.structured_output.manager import GrammarBitmask


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
