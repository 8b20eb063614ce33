"""What the scheduler hands the model runner each step, and what the engine core streams back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvik.request import Request
from kvik.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from kvik.structured_output.manager import GrammarBitmask


@dataclass(slots=True)  # not frozen: a frozen one's __init__ took 2 µs, 256 a decode step
class ScheduledRequest:
    """One request's share of a step: tokens ``all_token_ids[start:start + num_tokens]``. Not
    changed once ``schedule()`` has returned it. ``block_ids`` is the KV cache manager's own
    list of the request's blocks (``KVCacheManager.get_block_ids``), which later steps extend:
    read it while this step is prepared."""

    request: Request
    start: int  # num_computed_tokens before this step: position of the first scheduled token
    num_tokens: int
    block_ids: list[int]  # all of the request's blocks (so far), for the runner's block table
    samples: bool  # the step reaches the request's last token, so it samples a new one
    # Asynchronous scheduling: how many of the scheduled tokens (the last ones) are not known yet,
    # 0 or 1. Such a token is the request's output token sampled by the previous launched step,
    # not yet collected; its position is len(request.all_token_ids) when the step is launched,
    # and the runner takes it from that step's sampled tokens on the device.
    num_placeholder_tokens: int = 0
    # Speculative decoding: draft tokens scheduled after the request's last known token (the
    # last ``len(spec_token_ids)`` of the scheduled tokens). The step scores all of them and
    # the rejection sampler keeps a prefix; the scheduler rolls back the rest.
    spec_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    # Finished or aborted since the previous schedule(): the runner can drop their state. Under
    # asynchronous scheduling such a request may be in the step launched just before this one
    # (its token from there is dropped), never in this one.
    finished_req_ids: set[str] = field(default_factory=set)
    # Preempted in this step: their blocks are gone and they start over when readmitted.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: the token masks of the requests that sample under a grammar (filled by
    # the engine core after scheduling; the runner applies them to the logits before sampling).
    grammar_bitmask: GrammarBitmask | None = None


@dataclass
class TokenLogprobs:
    """Log-probabilities for one position: the chosen token first, then the top-N by rank."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (reason: stop_reason)
    stop_reason: int | str | None = None
    # An "error" that is the request's own fault (its structured-output constraint admits no
    # token, alone or with its allowed_token_ids / bad_words; its grammar does not compile): the
    # SamplingParams field at fault. None for an "error" that is the engine's (a request the
    # engine core could not take).
    error_param: str | None = None
    num_cached_tokens: int = 0
    # One entry per new token, when the request asked for logprobs.
    new_logprobs: list[TokenLogprobs] | None = None
    # Once, when the prompt has been computed, when the request asked for prompt logprobs:
    # one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int  # tokens, cumulative
    num_preemptions: int  # cumulative
    num_prefill_chunks: int  # cumulative: chunks ending before the end of their prompt
    num_steps: int  # cumulative
    # Speculative decoding's counts, cumulative (None when speculation is off).
    spec_decoding: SpecDecodingStats | None = None
