"""What the fields of an options dataclass (``EngineArgs``) say about themselves.

``EngineArgs`` is the one list of engine options. Each field's type, default and help text (its
``option(...)`` metadata) are read here, so that ``LLM(**kwargs)`` checks its keywords, the command
line builds its flags (kvik.cli.engine_args) and values are checked, all from that one list.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal


def option(
    default: Any,
    help: str,
    *,
    metavar: str | None = None,
    choices=None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A field of an options dataclass: its default and the help text its flag shows.

    ``choices`` lists the accepted names where the type cannot (a ``Literal`` type gives them
    itself); ``metavar`` names the value in ``--help``; ``aliases`` are more flags for it
    (vLLM's short ones, e.g. ``-tp``)."""
    metadata = {
        "help": help,
        "metavar": metavar,
        "choices": tuple(choices) if choices else None,
        "aliases": tuple(aliases),
    }
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class OptionSpec:
    """One option: ``kind`` is the type its command-line value parses to (bool, int, float, str
    or list, whose items are ``item``); ``accepts`` the Python types a value may have."""

    name: str
    kind: type
    default: Any
    help: str
    optional: bool
    accepts: tuple[Any, ...]
    choices: tuple[Any, ...] | None = None
    item: type | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@cache
def option_specs(cls: type) -> tuple[OptionSpec, ...]:
    """The options of the dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        members = _union_members(hints[f.name])
        optional = type(None) in members
        accepts = tuple(m for m in members if m is not type(None))
        first = accepts[0]
        choices = f.metadata.get("choices")
        item = None
        if typing.get_origin(first) is Literal:
            choices = typing.get_args(first)
            kind = type(choices[0])
        elif typing.get_origin(first) is list:
            kind, item = list, typing.get_args(first)[0]
        else:
            kind = first
        if kind not in (bool, int, float, str, list):
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for type {first!r}")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        specs.append(
            OptionSpec(
                name=f.name,
                kind=kind,
                default=default,
                help=f.metadata.get("help", ""),
                optional=optional,
                accepts=accepts,
                choices=choices,
                item=item,
                metavar=f.metadata.get("metavar"),
                aliases=f.metadata.get("aliases", ()),
            )
        )
    return tuple(specs)


def _union_members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def check_value(spec: OptionSpec, value: Any) -> Any:
    """``value`` if the option accepts it (a tuple for a list option comes back as a list);
    else a ValueError that names the option, what it takes and what it got."""
    if value is None and spec.optional:
        return value
    for accepted in spec.accepts:
        if typing.get_origin(accepted) is Literal:
            if isinstance(value, str) and value in typing.get_args(accepted):
                return value
        elif typing.get_origin(accepted) is list:
            if isinstance(value, list | tuple) and all(_is(spec.item, v) for v in value):
                return list(value)
        elif _is(accepted, value):
            if spec.choices and accepted is str and value not in spec.choices:
                break
            return value
    raise ValueError(f"{spec.name} must be {describe(spec)}, got {value!r}")


def _is(expected: type, value: Any) -> bool:
    """isinstance, but a bool is not an int or a float, and an int is a float."""
    if isinstance(value, bool):
        return expected is bool
    if expected is float:
        return isinstance(value, int | float)
    return isinstance(value, expected)


def describe(spec: OptionSpec) -> str:
    """What the option takes, in words: "one of 'fcfs', 'priority'", "an integer or None"."""
    if spec.choices:
        text = "one of " + ", ".join(repr(c) for c in spec.choices)
    elif spec.kind is list:
        text = f"a list of {_TYPE_WORDS[spec.item]}s"
    else:
        text = _A_TYPE_WORDS[spec.kind]
    for other in spec.accepts[1:]:  # a type beyond the command line's, as torch.dtype for dtype
        if isinstance(other, type):
            text += f" or a {other.__module__}.{other.__qualname__}"
    return text + " or None" if spec.optional else text


_TYPE_WORDS = {bool: "bool", int: "integer", float: "number", str: "string"}
_A_TYPE_WORDS = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def unknown_option_message(caller: str, name: str, known: list[str]) -> str:
    """An error message for the unknown option ``name``, suggesting the closest known one."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "the options are " + ", ".join(known)
    return f"{caller} got an unknown option {name!r}; {hint}"
