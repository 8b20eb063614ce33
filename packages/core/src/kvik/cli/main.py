"""The ``kvik`` command: a table of subcommands, each in a module of its own.

A subcommand's module defines ``add_arguments(parser)`` and ``run(args) -> int`` (the exit code).
Only the module of the subcommand being run is imported, so ``kvik env`` stays light whatever the
other subcommands import, and a subcommand whose package is missing breaks only itself.
"""

from __future__ import annotations

import argparse
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
    parser = argparse.ArgumentParser(
        prog="kvik", description="kvik: an LLM inference and serving engine."
    )
    parser.add_argument("--version", action="version", version=f"kvik {kvik.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_path, help_text) in all_commands().items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_path)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    return args.run(args)
