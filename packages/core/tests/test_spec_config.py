"""speculative_config: vLLM's keys checked with clear errors, reaching EngineConfig.speculative
from the command line and from LLM(...), and engines speculation does not run on refusing it clearly."""

from __future__ import annotations

import json
import re

import pytest

from kvik.cli.engine_args import engine_args
from kvik.cli.main import build_parser
from kvik.engine.args import EngineArgs
from kvik.spec_decode.config import SpeculativeConfig, parse_speculative_config


def test_ngram_defaults_follow_vllm():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    only_max = parse_speculative_config('{"num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert only_max.method == "ngram"  # inferred from the lookup keys, as vLLM does
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    both = SpeculativeConfig(3, "ngram", prompt_lookup_min=2, prompt_lookup_max=4)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (2, 4)


def test_model_methods():
    eagle = parse_speculative_config(
        {"method": "eagle3", "model": "/heads/x", "num_speculative_tokens": 3,
         "disable_by_batch_size": 8}
    )  # fmt: skip
    assert eagle.method == "eagle3" and eagle.model == "/heads/x"
    assert eagle.disable_by_batch_size == 8
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(eagle) is eagle


@pytest.mark.parametrize(
    "given, message",
    [
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "one of ngram, draft_model, eagle3"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "'eagle3' needs 'model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "model": "m", "num_speculative_tokens": 2}, "drop 'model'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "is larger than prompt_lookup_max",
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be",
        ),
        (
            {"method": "eagle3", "model": "m", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "apply to method 'ngram' only",
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
            "disable_by_batch_size must be",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, "['draft_tp']"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_configs_are_clear_errors(given, message):
    with pytest.raises(ValueError, match=_escaped(message)):
        parse_speculative_config(given)


def test_bad_json_is_a_clear_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_speculative_config("{method: ngram}")


def _escaped(text: str) -> str:
    return re.escape(text)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("kvik_cpu", reason="the CPU platform is not installed")
    pytest.importorskip("kvik_models", reason="kvik-models is not installed")
    from tiny_models import build_tiny_model

    return str(build_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def test_command_line_and_llm_keywords_reach_engine_config(tiny_llama):
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    parsed = build_parser("generate").parse_args(
        ["generate", "hi", "--model", tiny_llama, "--speculative-config", text]
    )
    args = engine_args(parsed)
    assert args.speculative_config == text
    config = args.create_engine_config()
    assert config.speculative == SpeculativeConfig(3, "ngram", None, 5, 5, None)
    as_dict = {"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 2}
    config = EngineArgs(model=tiny_llama, speculative_config=as_dict).create_engine_config()
    assert config.speculative == SpeculativeConfig(2, "eagle3", "/heads/h")
    assert EngineArgs(model=tiny_llama).create_engine_config().speculative is None
    with pytest.raises(ValueError, match="speculative_config must be"):
        EngineArgs(speculative_config=3)


def test_engine_refuses_speculation_it_does_not_run(tiny_llama):
    from kvik import LLM

    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="one in-process rank"):
        LLM(
            tiny_llama,
            dtype="float32",
            enforce_eager=True,
            tensor_parallel_size=2,
            speculative_config=ngram,
        )
    with pytest.raises(ValueError, match="synchronous scheduling only"):
        LLM(
            tiny_llama,
            dtype="float32",
            enforce_eager=True,
            async_scheduling=True,
            num_kv_blocks=64,
            speculative_config=ngram,
        )


@pytest.mark.parametrize(
    ("method", "graphs", "expected"),
    [
        ("eagle3", "full_and_piecewise", (0, "full")),
        ("eagle3", "piecewise", (0, "none")),
        ("ngram", "full_and_piecewise", (3, "full_and_piecewise")),
    ],
)
def test_eagle3_turns_compilation_off(method, graphs, expected, caplog):
    """EAGLE-3's hooks do not run inside compiled code: the engine runs the target's layers from
    Python, keeping FULL graphs (captured from such runs); other methods keep what was asked."""
    from types import SimpleNamespace

    from kvik.config import CompilationConfig
    from kvik.spec_decode.config import speculative_compilation

    extra = {"model": "head"} if method == "eagle3" else {"prompt_lookup_max": 3}
    speculative = {"method": method, "num_speculative_tokens": 3, **extra}
    config = SimpleNamespace(
        speculative=parse_speculative_config(speculative),
        compilation=CompilationConfig(mode=3, cudagraph_mode=graphs),
    )
    speculative_compilation(config)
    assert (config.compilation.mode, config.compilation.cudagraph_mode) == expected
    assert ("compilation mode 3 is turned off" in caplog.text) == (method == "eagle3")


def test_max_num_batched_tokens_defaults_by_platform_and_use(tiny_llama, monkeypatch):
    """The platform picks the default token budget, for a server or an offline run (the CUDA
    platform answers 16384 offline on large GPUs); a given value overrides it."""
    from kvik.platforms.selection import select_platform

    platform = select_platform("cpu")
    monkeypatch.setattr(
        platform,
        "default_max_num_batched_tokens",
        classmethod(lambda cls, serving: 1024 if serving else 4096),
    )
    offline = EngineArgs(model=tiny_llama, device="cpu").create_engine_config()
    served = EngineArgs(model=tiny_llama, device="cpu").create_engine_config(serving=True)
    assert offline.scheduler.max_num_batched_tokens == 4096
    assert served.scheduler.max_num_batched_tokens == 1024
    given = EngineArgs(model=tiny_llama, device="cpu", max_num_batched_tokens=300)
    assert given.create_engine_config().scheduler.max_num_batched_tokens == 300
