"""One generation request as the engine core tracks it: tokens, progress, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvik.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvik.structured_output.manager import StructuredOutputRequest

# A block hash is the sha256 digest of (parent hash, token ids, extra keys); see kv_cache.hashing.
BlockHash = bytes


class RequestStatus(enum.IntEnum):
    # Order matters: every status after PREEMPTED is a finished one.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    # Ended by the engine for a fault of the request's own (its constraint admits no token);
    # stop_reason says why and error_param names the parameter at fault.
    FINISHED_ERROR = 6

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # identity equality: the scheduler removes requests from its queues by object
class Request:
    """A request inside the engine core.

    ``max_tokens`` is resolved by the caller: ``min(sp.max_tokens or inf, max_model_len -
    len(prompt))``. ``eos_token_ids`` holds every EOS id of the model's generation config; it is
    ignored when ``sampling_params.ignore_eos`` is set. ``block_hashes`` are the chained hashes of
    the full blocks of ``all_token_ids``, extended by ``kv_cache.hashing.extend_block_hashes``.

    Under asynchronous scheduling ``num_output_placeholders`` counts the output tokens that
    scheduled steps will sample but that have not come back yet: the sequence the scheduler plans
    with is ``num_tokens + num_output_placeholders`` long, while ``all_token_ids`` (and so
    ``num_tokens`` and ``block_hashes``) only ever hold known tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    # sampling_params.bad_words as token-id sequences (the front end tokenizes them).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    # Prefix-cache hit at the first scheduling; -1 until then.
    num_cached_tokens: int = field(default=-1, init=False)
    num_preemptions: int = field(default=0, init=False)
    block_hashes: list[BlockHash] = field(default_factory=list, init=False)
    # The stop token id that ended the request (a stop string is set by the front end).
    stop_reason: int | str | None = field(default=None, init=False)
    # A request finished with an error (FINISHED_ERROR): the SamplingParams field at fault
    # ("structured_outputs", "allowed_token_ids", "bad_words"); stop_reason holds the message.
    error_param: str | None = field(default=None, init=False)
    # Output tokens scheduled to be sampled whose ids are not known yet (asynchronous scheduling
    # only; always 0 otherwise). At most 1 when a step is scheduled, 2 between scheduling a step
    # and collecting the one before it.
    num_output_placeholders: int = field(default=0, init=False)
    # The grammar of sampling_params.structured_outputs, set by the engine core's
    # StructuredOutputManager when the request is added.
    structured_output: StructuredOutputRequest | None = field(default=None, init=False)
    # Speculative decoding: the draft tokens the proposer made after the last step, to verify
    # in the next one (scheduled after the last known token, within the token budget).
    spec_token_ids: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt_token_ids must not be empty")
        if self.max_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens} "
                "(is the prompt as long as the model's context?)"
            )
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.is_finished()

    def stop_token_set(self) -> frozenset[int]:
        """The tokens that end this request when sampled (once min_tokens is met, which forbids
        them before): its stop_token_ids, and its EOS ids unless it ignores EOS."""
        p = self.sampling_params
        stops = frozenset(p.stop_token_ids or ())
        return stops if p.ignore_eos else stops | self.eos_token_ids

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling this request's next token reads its output so far: the logits
        processors of ``kvik.layers.logits_processors`` that look at ``output_token_ids`` (bad
        words, min tokens while short of them, repetition / presence / frequency penalties).
        Logit bias and allowed tokens do not. Keep in step with ``build_logits_processors``.
        A grammar (structured outputs) does too: its mask depends on every token so far."""
        p = self.sampling_params
        return (
            p.structured_outputs is not None
            or bool(self.bad_words_token_ids)
            or self.num_output_tokens < p.min_tokens
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
        )

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)
