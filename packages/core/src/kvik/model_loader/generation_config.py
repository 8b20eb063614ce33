"""The sampling defaults a model recommends, as vLLM's ``--generation-config`` reads them.

A model's ``generation_config.json`` (or a GGUF's ``general.sampling.*`` metadata) may say how it
should be sampled: Qwen3, say, asks for temperature 0.6, top-k 20 and top-p 0.95, and repeats
itself when decoded greedily. Where a request leaves a sampling option unset (``LLM.generate`` or
``chat`` without ``SamplingParams``, a server request without ``temperature``, a ``kvik generate``
without ``--temperature``), the model's value applies, and kvik's own default only where the model
has none.

The engine option ``generation_config`` chooses the source: ``"auto"`` (the model's own),
``"vllm"`` or ``"none"`` (kvik's defaults alone, as vLLM's ``--generation-config vllm``), or a
folder holding a ``generation_config.json``. Only the sampling options are read from it; the tokens
that end generation always come from the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvik.config import read_generation_config

#: generation_config.json keys that give sampling defaults (vLLM reads the same ones).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
#: The values of the option that mean kvik's own defaults.
OWN_DEFAULTS = ("vllm", "none")


def sampling_defaults(option: str, model_generation_config: dict[str, Any]) -> dict[str, Any]:
    """The generation-config sampling keys that apply under the ``generation_config`` option."""
    if not isinstance(option, str):
        raise ValueError(
            f"generation_config must be 'auto', 'vllm', 'none' or a folder, got {option!r}"
        )
    if option == "auto":
        source = model_generation_config
    elif option in OWN_DEFAULTS:
        return {}
    else:
        folder = Path(option).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(
                f"generation_config={option!r}: expected 'auto', 'vllm', 'none' or a folder "
                f"holding generation_config.json, and {folder} has none"
            )
        source = read_generation_config(folder)
    defaults = {key: source[key] for key in SAMPLING_KEYS if source.get(key) is not None}
    _check(defaults, option)
    return defaults


def _check(defaults: dict[str, Any], option: str) -> None:
    """Fail on a default no request could use, at load time rather than at the first request."""
    from kvik.sampling_params import SamplingParams

    try:
        SamplingParams.from_generation_config(defaults)
    except ValueError as e:
        where = "the model's generation config" if option == "auto" else repr(option)
        raise ValueError(f"{where} gives an invalid sampling default: {e}") from None
