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
    finish_reason: str | None  # "stop", "length" or "abort"; None while unfinished
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
