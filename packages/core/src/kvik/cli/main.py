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

#: Subcommand name -> (module path, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("kvik.cli.env", "show versions, plugins, platforms and what the plugins registered"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments."""
    parser = argparse.ArgumentParser(
        prog="kvik", description="kvik: an LLM inference and serving engine."
    )
    parser.add_argument("--version", action="version", version=f"kvik {kvik.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_path, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_path)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    return args.run(args)
