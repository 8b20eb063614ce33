"""The engine's command-line flags, made from the fields of ``EngineArgs``.

Shared by ``kvik generate``, ``kvik chat``, ``kvik bench throughput|latency`` and ``kvik serve``:
each field becomes ``--field-name`` with its type, choices, default and help text; a bool becomes
``--x`` / ``--no-x`` (as vLLM's flags), a list takes several values. A new field of EngineArgs is
a new flag of every command without an edit here.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvik.engine.args import EngineArgs
from kvik.engine.options import OptionSpec, option_specs
from kvik.sampling_params import SamplingParams


def add_engine_arguments(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """Add a flag for every engine option; ``positional_model`` also takes the model as the first
    positional argument (``kvik serve MODEL``)."""
    group = parser.add_argument_group("engine options")
    if positional_model:
        group.add_argument("model_positional", nargs="?", metavar="MODEL", help="same as --model")
    for spec in option_specs(EngineArgs):
        group.add_argument(spec.flag, *spec.aliases, dest=spec.name, **_argparse_kwargs(spec))


def _argparse_kwargs(spec: OptionSpec) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"default": spec.default, "help": spec.help}
    if spec.kind is bool:
        # argparse adds the default to a BooleanOptionalAction's help itself.
        kwargs["action"] = argparse.BooleanOptionalAction
        return kwargs
    if spec.default is not None and "default" not in spec.help:
        kwargs["help"] = f"{spec.help} (default: {spec.default})"
    if spec.kind is list:
        kwargs.update(nargs="+", type=_item_parser(spec.item), action=_Flatten)
    else:
        kwargs["type"] = spec.kind
    if spec.choices:
        kwargs["choices"] = spec.choices
    if spec.metavar:
        kwargs["metavar"] = spec.metavar
    return kwargs


def _item_parser(item: type):
    """A list flag's item parser: ``--sizes 1 2 4`` and ``--sizes 1,2,4`` are the same."""

    def parse(text: str) -> list[Any]:
        try:
            return [item(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {item.__name__} values, got {text!r}"
            ) from None

    parse.__name__ = item.__name__  # argparse names the type in its error messages
    return parse


class _Flatten(argparse.Action):
    """Store a list flag's values as one list (each value may hold several, comma-separated)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [item for value in values for item in value])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``kvik.LLM`` keyword arguments (EngineArgs' fields) the parsed flags ask for."""
    kwargs = {spec.name: getattr(args, spec.name) for spec in option_specs(EngineArgs)}
    positional = getattr(args, "model_positional", None)
    if positional is not None:
        if kwargs["model"] is not None and kwargs["model"] != positional:
            raise ValueError(
                f"the model is given twice, as {positional!r} and --model {kwargs['model']!r}"
            )
        kwargs["model"] = positional
    return kwargs


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs the parsed flags ask for."""
    return EngineArgs(**engine_kwargs(args))


#: The sampling flags a model's generation config gives defaults for -> its key there.
_MODEL_DEFAULTED = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
#: The command line's own defaults, under the model's: greedy, and longer replies than the API's.
_COMMAND_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 256}


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    model = "default: the model's generation config's"
    parser.add_argument("--max-tokens", type=int, default=None, help=f"{model}, else 256")
    parser.add_argument("--temperature", type=float, default=None, help=f"{model}, else 0 (greedy)")
    parser.add_argument("--top-p", type=float, default=None, help=f"{model}, else 1")
    parser.add_argument("--top-k", type=int, default=None, help=f"{model}, else 0 (off)")
    parser.add_argument("--min-p", type=float, default=None, help=f"{model}, else 0")
    parser.add_argument("--repetition-penalty", type=float, default=None, help=f"{model}, else 1")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace, model_defaults: dict[str, Any]) -> SamplingParams:
    """The flags given, else the model's sampling defaults (``ModelConfig.sampling_defaults``),
    else the command line's own."""
    given = {name: getattr(args, name) for name in _MODEL_DEFAULTED}
    return SamplingParams.from_generation_config(
        {**_COMMAND_DEFAULTS, **model_defaults},
        **{name: value for name, value in given.items() if value is not None},
        seed=args.sampling_seed,
        stop=args.stop,
    )
