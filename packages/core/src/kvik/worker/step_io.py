"""What a step hands between the runner, its step runner and the executors: the prepared inputs
(``StepInputs``, views of the runner's persistent buffers), a launched step (``PendingStep``) and
what it produced (``ModelRunnerOutput``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from kvik.attention.backend import AttentionMetadata
from kvik.layers.sampler import SamplingBatch
from kvik.scheduler.output import TokenLogprobs

if TYPE_CHECKING:
    from kvik.request import Request


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Complete prompt logprobs of requests whose prompt finished computing in this step.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: the drafts proposed for each request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepInputs:
    """One prepared step: views of the runner's persistent device buffers."""

    input_ids: Tensor  # [T_pad]
    positions: Tensor  # [T_pad]
    attn_metadata: object  # the backend's metadata
    logits_indices: Tensor  # [sum(k_i + 1)] rows of the hidden states that sample
    #: T, the rows of the scheduled requests (``query_starts`` index them); rows T..T_pad are
    #: padding. A request's rows are its scheduled tokens, then (in a uniform verification) rows
    #: of padding up to ``uniform_query_len``.
    num_tokens: int
    num_padded: int  # T_pad
    #: Every request has this many rows and samples, and none needs prompt logprobs: 1 for a
    #: decode, 1 + k for a verification of up to k drafts a request; a step that a FULL CUDA graph
    #: of the step runner replays (``StepRunner.uniform_batch_size``). 0: any other step.
    uniform_query_len: int
    query_starts: list[int]  # [R] first row of each scheduled request
    sampling_requests: list[Request]  # the N requests that sample, in row order
    #: Their settings, staged with the other inputs (None when nothing samples).
    sampling: SamplingBatch | None = None
    #: Speculative decoding: per sampling request, its draft tokens scored in this step (each
    #: request's logits rows are its drafts' positions, then the position after them).
    draft_token_ids: list[tuple[int, ...]] = field(default_factory=list)
    #: The backend-neutral metadata the backend's was built from (a draft model builds its own).
    common_metadata: AttentionMetadata | None = None

    @property
    def uniform_decode(self) -> bool:
        return self.uniform_query_len == 1

    @property
    def num_draft_tokens(self) -> list[int]:
        return [len(d) for d in self.draft_token_ids]

    @property
    def has_drafts(self) -> bool:
        return any(self.draft_token_ids)

    @property
    def num_sampling(self) -> int:
        return len(self.sampling_requests)


class PendingStep:
    """A launched step. ``collect()`` waits for its sampled tokens (the one host-device sync of a
    step) and reads what the device computed into a ``ModelRunnerOutput``."""

    def __init__(
        self,
        requests: list[Request] | None = None,
        sampled_host: Tensor | None = None,
        done: object | None = None,
        finishers: list[Callable[[ModelRunnerOutput], None]] | None = None,
        output: ModelRunnerOutput | None = None,
    ) -> None:
        """``output``: a step already read back (speculative decoding's, which proposes the
        next step's drafts from the tokens it accepted)."""
        self._requests = requests or []
        self._sampled_host = sampled_host  # pinned [>= N] int64
        self._done = done  # a device event recorded after the copy to sampled_host; None: ready
        self._finishers = finishers or []
        self._output: ModelRunnerOutput | None = output

    def ready(self) -> bool:
        """Whether ``collect()`` would return without waiting for the device."""
        return self._output is not None or self._done is None or self._done.query()

    def collect(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        if self._done is not None:
            self._done.synchronize()
        output = ModelRunnerOutput()
        if self._requests:
            tokens = self._sampled_host[: len(self._requests)].tolist()
            for request, token in zip(self._requests, tokens):
                output.sampled_token_ids[request.request_id] = [token]
        for finish in self._finishers:  # logprobs, read now that the device is done
            finish(output)
        self._output = output
        return output
