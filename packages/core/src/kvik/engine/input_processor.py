"""Turning user prompts into validated Requests, and output token ids back into text."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvik.config import ModelConfig
from kvik.request import Request
from kvik.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: A prompt: text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}.
PromptType = str | Sequence[int] | dict[str, Any]

# Fields validated now whose behaviour lands with the text issue; until then a request using them is
# refused rather than silently ignored.
_NOT_YET = {
    "stop": lambda p: bool(p.stop),
    "logprobs": lambda p: p.logprobs is not None,
    "prompt_logprobs": lambda p: p.prompt_logprobs is not None,
    "presence_penalty": lambda p: p.presence_penalty != 0.0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
    "logit_bias": lambda p: bool(p.logit_bias),
    "allowed_token_ids": lambda p: p.allowed_token_ids is not None,
    "bad_words": lambda p: bool(p.bad_words),
}


def load_tokenizer(name_or_path: str | Path) -> Any | None:
    """The model folder's Hugging Face tokenizer, or None when the folder has none."""
    path = Path(name_or_path)
    if not any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class InputProcessor:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.tokenizer = load_tokenizer(model_config.tokenizer or model_config.path)
        self.eos_token_ids = model_config.eos_token_ids()

    @staticmethod
    def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [prompts]  # one prompt of token ids
        if not prompts:
            raise ValueError("prompts must not be empty")
        return prompts

    def process(
        self, prompt: PromptType, params: SamplingParams
    ) -> tuple[str | None, list[int], SamplingParams]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        for name, is_set in _NOT_YET.items():
            if is_set(params):
                raise ValueError(f"SamplingParams.{name} is not supported yet by this kvik version")
        text, token_ids = self._tokens(prompt)
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        bad = [
            t
            for t in token_ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}"
                + (" ..." if len(bad) > 5 else "")
            )
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {max_len}: it must be "
                "shorter, to leave room for at least one generated token"
            )
        params.validate_token_ids(vocab)
        return text, token_ids, params

    def _tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"text prompts need a tokenizer, and {self.model_config.path} has none: pass "
                    "token ids, or tokenizer=<folder>"
                )
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__}"
        )

    def make_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
    ) -> Request:
        room = self.model_config.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=arrival_time,
            priority=priority,
        )

    def decode(self, token_ids: Sequence[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=params.skip_special_tokens
        )
