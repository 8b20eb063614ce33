"""``--speculative-config`` / ``LLM(speculative_config={...})``: vLLM's keys, checked.

{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
{"method": "eagle3", "model": "path/to/head", "num_speculative_tokens": 3}
{"method": "draft_model", "model": "path/to/small-model", "num_speculative_tokens": 4}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from kvik.config import COMPILATION_MODE_NONE

logger = logging.getLogger(__name__)

SpeculativeMethod = Literal["ngram", "draft_model", "eagle3"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)

#: vLLM's n-gram default when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int
    method: SpeculativeMethod | None = None
    #: A draft model's folder or hub id (draft_model), an EAGLE-3 head's folder (eagle3).
    model: str | None = None
    #: n-gram sizes to match, longest first (ngram only).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    #: Speculation turns off for a step whose batch holds more requests than this.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative model must be a path or hub id, got {self.model!r}")
        self._resolve_method()
        if self.method == "ngram":
            self._check_ngram()
        else:
            given = [n for n in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, n)]
            if given:
                raise ValueError(f"{', '.join(given)} apply to method 'ngram' only")
            if self.model is None:
                raise ValueError(f"speculative method {self.method!r} needs 'model'")
        size = self.disable_by_batch_size
        if size is not None and (not _is_int(size) or size < 2):
            raise ValueError(f"disable_by_batch_size must be an integer >= 2, got {size!r}")

    def _resolve_method(self) -> None:
        if self.method is None:
            lookup = self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
            if self.model is None and lookup:
                self.method = "ngram"
            else:
                raise ValueError(
                    "speculative_config needs 'method': one of " + ", ".join(SPECULATIVE_METHODS)
                )
        if self.method == "[ngram]":  # vLLM's older spelling
            self.method = "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError("method 'ngram' proposes from the request's own tokens; drop 'model'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) is larger than prompt_lookup_max ({high})")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    @classmethod
    def from_dict(cls, given: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(given, dict):
            raise ValueError(f"speculative_config must be a JSON object / dict, got {given!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(
                f"speculative_config keys {unknown} are not supported; kvik reads "
                f"{', '.join(known)}"
            )
        if "num_speculative_tokens" not in given:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        return cls(**given)


def parse_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """The option's value (JSON text from the command line, a dict from ``LLM(...)``) checked."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not valid JSON: {error}") from None
    return SpeculativeConfig.from_dict(value)


def check_speculative_engine(config: Any) -> None:
    """Refuse, with a clear message, engines speculation does not run on (``config``: the
    EngineConfig): more drafts than a sequence holds, tensor parallelism, and model runners in
    other processes (the drafts are proposed in the runner of an in-process rank, and steps carry
    them to it only there)."""
    speculative = config.speculative
    if speculative is None:
        return
    k, max_model_len = speculative.num_speculative_tokens, config.model.max_model_len
    if k >= max_model_len:
        # (The runner's buffers scale with k: a mistyped 10**7 would take all the memory.)
        raise ValueError(
            f"num_speculative_tokens ({k}) must be smaller than max_model_len ({max_model_len}): "
            "a request's drafts and the token before them must fit in it"
        )
    parallel = config.parallel
    if parallel.world_size > 1 or parallel.executor_backend != "uni":
        raise ValueError(
            f"speculative decoding (method {speculative.method!r}) runs with one in-process rank "
            f"(the 'uni' executor); this engine has tensor_parallel_size="
            f"{parallel.tensor_parallel_size} and executor {parallel.executor_backend!r}"
        )


def speculative_compilation(config: Any) -> None:
    """EAGLE-3 reads the target's hidden states through module hooks on three decoder layers
    (kvik.spec_decode.eagle3_proposer), which compiled code does not run: with it, the target runs
    its layers from Python, and FULL CUDA graphs captured from such runs (which replay the hooks'
    copies) are kept, PIECEWISE graphs (of the compiled model) are not. ``config``: the
    EngineConfig, changed in place, with a warning where the user asked for compilation."""
    speculative = config.speculative
    compilation = config.compilation
    if speculative is None or speculative.method != "eagle3" or not compilation.compiled:
        return
    mode = {"piecewise": "none", "full_and_piecewise": "full"}.get(
        compilation.cudagraph_mode, compilation.cudagraph_mode
    )
    logger.warning(
        "EAGLE-3 reads hidden states the compiled model does not expose: compilation mode 3 is "
        "turned off (cudagraph_mode %s -> %s)",
        compilation.cudagraph_mode,
        mode,
    )
    compilation.mode = COMPILATION_MODE_NONE
    compilation.cudagraph_mode = mode


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
