"""The ``kvik`` command: a table of subcommands, each in a module of its own.

A subcommand's module defines ``add_arguments(parser)`` and ``run(args) -> int`` (the exit code).
Only the module of the subcommand being run is imported, so ``kvik env`` stays light whatever the
other subcommands import, and a subcommand whose package is missing breaks only itself.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence

import kvik

#: Core's subcommands: name -> (module path, one-line help). Other packages add theirs through
#: the ``kvik_register_commands`` hook (the server's ``serve``).
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("kvik.cli.env", "show versions, plugins, platforms and what the plugins registered"),
    "generate": ("kvik.cli.generate", "generate a reply to one prompt and print it"),
    "chat": ("kvik.cli.chat", "chat with a model in the terminal, streaming the replies"),
    "export": ("kvik.cli.export", "write a model as a Hugging Face folder (safetensors)"),
    "bench": ("kvik.cli.bench", "benchmark throughput, latency, or a running server"),
}


def all_commands() -> dict[str, tuple[str, str]]:
    from kvik.plugins.manager import get_plugin_manager

    manager = get_plugin_manager()
    commands = dict(COMMANDS)
    for name in manager.commands.names():
        if name not in commands:
            commands[name] = (manager.commands.targets[name], manager.command_help.get(name, ""))
    return commands


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments."""
    # No abbreviated flags: with the engine's flags made from EngineArgs, an abbreviation that works
    # today could become ambiguous, or mean another option, when a field is added.
    parser = argparse.ArgumentParser(
        prog="kvik", description="kvik: an LLM inference and serving engine.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"kvik {kvik.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_path, help_text) in all_commands().items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if name == command:
            module = importlib.import_module(module_path)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = parse_args(build_parser(command), argv)
    return args.run(args)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown flag's error suggests the closest known flag."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(unknown_arguments_message(parser, unknown, argv))
    return args


def unknown_arguments_message(
    parser: argparse.ArgumentParser, unknown: list[str], argv: Sequence[str] | None = None
) -> str:
    """The error for unknown flags, each with the closest flag of the command line's
    subcommands (``argv``'s; every subcommand's where it is not given)."""
    known = sorted(_option_strings(parser, None if argv is None else set(argv)))
    hints = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(unknown)}"
    return f"{message} ({'; '.join(hints)})" if hints else message


def _option_strings(parser: argparse.ArgumentParser, words: set[str] | None = None) -> set[str]:
    """The long flags of ``parser`` and of its subcommands' parsers, recursively: those of the
    subcommands named in ``words`` (the command line's), or of all of them. (A flag of another
    subcommand is no hint: ``kvik bench latency --num-prompts`` was told "did you mean
    --num-prompts?", a flag of ``bench throughput``. argparse lists a parser's actions only in
    ``_actions``; Python 3.14's ``suggest_on_error`` covers choices, not flags.)"""
    flags = {s for action in parser._actions for s in action.option_strings if s.startswith("--")}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if words is None or name in words:
                    flags |= _option_strings(sub, words)
    return flags
