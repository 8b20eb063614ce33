"""Every engine option (a field of EngineArgs) reaches EngineArgs from the command line of each
command that runs an engine and from ``LLM(**kwargs)``, with its type; unknown ones are clear
errors. No model is built: the LLM path is cut off where the EngineArgs is complete."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import pytest
import torch

from kvik.cli.engine_args import add_engine_arguments, engine_args
from kvik.cli.main import build_parser, main
from kvik.engine.args import EngineArgs
from kvik.engine.options import OptionSpec, option_specs

SPECS = option_specs(EngineArgs)

#: The commands that build an engine, with what they need before the engine flags.
COMMANDS = {
    "generate": ["generate", "a prompt"],
    "chat": ["chat"],
    "bench throughput": ["bench", "throughput"],
    "bench latency": ["bench", "latency"],
    "serve": ["serve"],
}


def not_the_default(spec: OptionSpec) -> tuple[list[str], Any]:
    """Flags that set the option to a value other than its default, and that value as
    EngineArgs must then hold it."""
    if spec.kind is bool:
        if spec.default is True:
            return [f"--no-{spec.flag[2:]}"], False
        return [spec.flag], True
    if spec.kind is list:
        return [spec.flag, "3", "1,2"], [3, 1, 2]
    if spec.choices:
        choice = next(c for c in spec.choices if c != spec.default)
        return [spec.flag, choice], choice
    value = {int: 7, float: 0.5, str: f"a-{spec.name}"}[spec.kind]
    return [spec.flag, str(value)], value


def everything_not_the_default() -> tuple[list[str], dict[str, Any]]:
    argv: list[str] = []
    expected: dict[str, Any] = {}
    for spec in SPECS:
        flags, value = not_the_default(spec)
        argv += flags
        expected[spec.name] = value
    return argv, expected


def parse(command: str, argv: list[str]) -> argparse.Namespace:
    if command == "serve":
        pytest.importorskip("kvik_server")
    words = COMMANDS[command]
    return build_parser(words[0]).parse_args([*words, *argv])


def test_every_option_has_help_and_a_flag_of_its_name():
    assert [spec.name for spec in SPECS] == [f.name for f in dataclasses.fields(EngineArgs)]
    for spec in SPECS:
        assert spec.help.strip(), f"EngineArgs.{spec.name} has no help text"
        assert spec.flag == "--" + spec.name.replace("_", "-")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_reaches_engine_args_from_the_command_line(command):
    argv, expected = everything_not_the_default()
    args = engine_args(parse(command, argv))
    for name, value in expected.items():
        got = getattr(args, name)
        assert got == value and type(got) is type(value), (name, got, value)
    # Given no flags, the command runs the engine with EngineArgs' defaults.
    assert engine_args(parse(command, [])) == EngineArgs()


def test_bool_flags_turn_each_way_and_tri_state_ones_keep_none():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for spec in (s for s in SPECS if s.kind is bool):
        on = engine_args(parser.parse_args([spec.flag]))
        off = engine_args(parser.parse_args([f"--no-{spec.flag[2:]}"]))
        assert getattr(on, spec.name) is True and getattr(off, spec.name) is False
    assert EngineArgs().async_scheduling is None  # not given: the platform decides


def test_serve_takes_the_model_as_its_positional_argument():
    assert engine_args(parse("serve", ["some/model"])).model == "some/model"
    assert engine_args(parse("serve", ["m", "--model", "m"])).model == "m"
    with pytest.raises(ValueError, match="given twice"):
        engine_args(parse("serve", ["m", "--model", "other"]))


def test_server_options_stay_the_servers():
    pytest.importorskip("kvik_server")
    args = parse("serve", ["--port", "9000", "--api-key", "k", "--max-num-seqs", "4"])
    assert args.port == 9000 and args.api_key == ["k"]
    assert engine_args(args).max_num_seqs == 4
    assert not hasattr(EngineArgs(), "port")


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["generate", "hi", "--max-num-seq", "4"], "did you mean --max-num-seqs?"),
        (["chat", "--enable-prefix-cache"], "did you mean --enable-prefix-caching?"),
        (["bench", "latency", "--enforce-eagr"], "did you mean --enforce-eager?"),
        (["generate", "hi", "--nothing-like-it"], "unrecognized arguments: --nothing-like-it"),
    ],
)
def test_an_unknown_flag_is_an_error_that_names_the_closest(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert hint in capsys.readouterr().err


def test_an_unknown_flag_is_not_matched_to_another_subcommands(capsys):
    """``bench latency --num-prompts`` was told "did you mean --num-prompts?": the flag of
    ``bench throughput``, which bench latency does not take either."""
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--num-prompts", "2"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --num-prompts 2" in err
    assert "did you mean --num-prompts?" not in err


def test_flags_are_never_abbreviated(capsys):
    """An abbreviation would silently change meaning once a field with a longer name is added."""
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--max-model", "64"])
    assert "did you mean --max-model-len?" in capsys.readouterr().err


def test_a_bad_flag_value_is_an_error(capsys):
    for argv, words in [
        (["--scheduling-policy", "lifo"], "invalid choice: 'lifo'"),
        (["--max-num-seqs", "many"], "invalid int value: 'many'"),
        (["--cudagraph-capture-sizes", "1,x"], "expected int values, got '1,x'"),
    ]:
        with pytest.raises(SystemExit):
            parse("generate", argv)
        assert words in capsys.readouterr().err


class _Built(Exception):
    def __init__(self, args: EngineArgs) -> None:
        self.engine_args = args


@pytest.fixture
def capture_llm_engine_args(monkeypatch):
    """LLM(...) stops with the EngineArgs it made, before it would load a model."""

    def stop(self: EngineArgs):
        raise _Built(self)

    monkeypatch.setattr(EngineArgs, "create_engine_config", stop)

    def build(*args, **kwargs) -> EngineArgs:
        from kvik import LLM

        with pytest.raises(_Built) as built:
            LLM(*args, **kwargs)
        return built.value.engine_args

    return build


def test_every_option_reaches_engine_args_from_llm(capture_llm_engine_args):
    _, expected = everything_not_the_default()
    assert capture_llm_engine_args(**expected) == EngineArgs(**expected)
    assert capture_llm_engine_args() == EngineArgs()
    assert capture_llm_engine_args("a/model", seed=3) == EngineArgs(model="a/model", seed=3)


def test_llm_shows_every_option_in_its_signature():
    from kvik import LLM

    params = inspect.signature(LLM).parameters
    assert list(params) == [spec.name for spec in SPECS]
    assert all(params[spec.name].default == spec.default for spec in SPECS)


def test_an_unknown_llm_keyword_names_the_closest_option(capture_llm_engine_args):
    with pytest.raises(
        TypeError,
        match=r"LLM\(\) got an unknown option 'max_num_seq'; did you "
        r"mean 'max_num_seqs'\?",
    ):
        capture_llm_engine_args(max_num_seq=4)
    with pytest.raises(TypeError, match="the options are model, tokenizer, device"):
        capture_llm_engine_args(nothing_like_it=1)
    with pytest.raises(TypeError, match="positional argument"):
        capture_llm_engine_args("model", "cpu")  # only the model is positional


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": "4"}, "max_num_seqs must be an integer or None, got '4'"),
        ({"max_num_seqs": True}, "max_num_seqs must be an integer or None, got True"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
        ({"enforce_eager": 1}, "enforce_eager must be True or False, got 1"),
        ({"async_scheduling": "yes"}, "async_scheduling must be True or False or None"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of 'fcfs', 'priority'"),
        ({"dtype": "fp8"}, "dtype must be one of 'auto', .* or a torch.dtype, got 'fp8'"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*32\), got -1"),  # was NumPy's error
        ({"seed": 2**32}, r"seed must be in \[0, 2\*\*32\)"),
        ({"cudagraph_capture_sizes": [1, "2"]}, "must be a list of integers or None"),
        ({"ops_dispatch": "native"}, "ops_dispatch must be one of 'torch_ops', 'direct'"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_values_python_callers_may_pass_are_accepted():
    args = EngineArgs(
        dtype=torch.bfloat16, cudagraph_capture_sizes=(4, 1), gpu_memory_utilization=1
    )
    assert args.dtype is torch.bfloat16 and args.cudagraph_capture_sizes == [4, 1]


def test_options_set_after_construction_are_checked_again():
    args = EngineArgs()
    args.max_num_seqs = "8"
    with pytest.raises(ValueError, match="max_num_seqs must be an integer"):
        args.create_engine_config()


def test_bench_records_the_options_that_are_not_the_defaults():
    from kvik.bench.common import non_default_engine_args

    argv, expected = everything_not_the_default()
    args = parse("bench throughput", argv)
    recorded = non_default_engine_args(args)
    measured = {"model", "tokenizer", "device", "dtype", "load_format", "seed"}
    assert recorded == {k: v for k, v in expected.items() if k not in measured}


def test_tensor_parallel_flags_take_vllms_short_form_and_backend_names():
    args = engine_args(parse("generate", ["-tp", "2", "--distributed-executor-backend", "mp"]))
    assert args.tensor_parallel_size == 2 and args.distributed_executor_backend == "mp"
    assert engine_args(parse("generate", ["--tensor-parallel-size", "4"])).tensor_parallel_size == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer, got 0"),
        ({"distributed_executor_backend": "ray"}, "must be one of 'uni', 'mp'"),
    ],
)
def test_bad_parallel_options_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_the_uni_executor_refuses_more_than_one_rank():
    args = EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="'uni' runs one rank; tensor_parallel_size=2 needs 'mp'"):
        args.create_engine_config()
