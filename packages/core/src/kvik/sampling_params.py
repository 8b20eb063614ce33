"""Sampling parameters of one request, with vLLM's field names, defaults and rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# vLLM treats a temperature this small as greedy: dividing logits by it would overflow.
_GREEDY_EPS = 1e-5


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but n=True is a bug in the caller, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
        raise ValueError(f"{name} must be a list of ints, got {value!r}")
    return list(value)


def _str_list(name: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of strings, got {value!r}")
    return list(value)


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's ``StructuredOutputsParams``).

    Exactly one of the kinds is set: ``json`` (a JSON schema, as a dict or its text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar``
    (EBNF). The engine compiles it and masks the logits so that every output follows it.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    #: Forbid whitespace between JSON tokens that the schema does not need.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in self._KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(kinds) if kinds else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a schema (dict or str), got {self.json!r}"
            )
        for name in ("json_object", "disable_any_whitespace"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(
                    f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}"
                )
        if self.choice is not None:
            self.choice = _str_list("structured_outputs.choice", self.choice)
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")

    _KINDS = ("json", "json_object", "regex", "choice", "grammar")

    @property
    def kind(self) -> str:
        return next(name for name in self._KINDS if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt (see vLLM's ``SamplingParams``).

    ``top_k`` of 0 or -1 turns top-k off (-1 is normalised to 0). ``max_tokens=None`` means up to
    the model's context length. ``logprobs``/``prompt_logprobs`` of -1 mean the whole vocabulary.
    Every rule is checked on construction and broken ones raise ``ValueError`` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _str_list("stop", self.stop)
        if "" in self.stop:
            # "" is found everywhere: the request would stop at its first token (as vLLM refuses).
            raise ValueError("stop must not hold an empty string")
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                # An empty allow-list would leave nothing to sample.
                raise ValueError("allowed_token_ids must not be empty when given")
        if self.bad_words is not None:
            self.bad_words = _str_list("bad_words", self.bad_words)
            if "" in self.bad_words:
                # "" would be banned as its space-prefixed form, " ": the space token itself.
                raise ValueError("bad_words must not hold an empty string")
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not 0 <= self.temperature < math.inf:  # NaN fails too: it would sample garbage
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            # A 64-bit signed integer, as vLLM's API takes it (and as it crosses to the engine).
            raise ValueError(f"seed must be an int in [-2**63, 2**63) or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(
                    f"{name} must be an int >= 0 (or -1 for the whole vocabulary), got {value!r}"
                )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id):
                    raise ValueError(f"logit_bias keys must be int token ids, got {token_id!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @classmethod
    def from_generation_config(cls, gen_config: dict[str, Any], **overrides: Any) -> SamplingParams:
        """Defaults from a Hugging Face ``generation_config.json``; ``overrides`` win over them.

        Only the sampling knobs are taken, as vLLM does; ``do_sample=False`` is not read because
        vLLM ignores it too (a user asks for greedy with temperature 0).
        """
        mapping = {
            "temperature": "temperature",
            "top_p": "top_p",
            "top_k": "top_k",
            "min_p": "min_p",
            "repetition_penalty": "repetition_penalty",
            "max_new_tokens": "max_tokens",
        }
        kwargs = {
            ours: gen_config[theirs]
            for theirs, ours in mapping.items()
            if gen_config.get(theirs) is not None
        }
        kwargs.update(overrides)
        return cls(**kwargs)

    def validate_token_ids(self, vocab_size: int) -> None:
        """Check that every token id the request names exists in a vocabulary of this size."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad}")
