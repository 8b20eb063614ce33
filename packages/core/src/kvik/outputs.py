"""What ``LLM.generate`` returns, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's raw logits (before temperature or penalties)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


#: Per generated token: token id -> Logprob, holding the sampled token and the top-N.
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt token (None for the first, which nothing predicts).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # "stop", "length", "abort" or "error" (the request failed: stop_reason says why, and
    # LLM.generate raises RequestError for it); None while unfinished
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: SampleLogprobs | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None


class RequestError(ValueError):
    """A request the engine ended because of its own parameters: its structured-output
    constraint admits no token where the output stands (alone, or with its allowed_token_ids,
    bad_words or min_tokens), or its grammar does not compile. The caller's error, as any
    ValueError for bad input; the engine and its other requests run on.

    ``param``: the SamplingParams field at fault ("structured_outputs", "allowed_token_ids",
    "bad_words", "min_tokens"). ``outputs`` (from ``LLM.generate``): every output of the call,
    the failed ones finished "error" with the reason as their stop_reason, the others complete.
    """

    def __init__(
        self,
        message: str,
        param: str | None = None,
        outputs: list[RequestOutput] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.outputs = outputs
