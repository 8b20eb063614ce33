"""Every kvik name that docs/architecture.md gives in backticks exists in the code.

What is checked, and how a name is recognised (only backticked spans, plus paths inside untagged
fenced blocks, which are the document's file listings; a fenced block with a language tag is an
example for a vendor and names things that do not exist):

- dotted names rooted at a kvik package (``kvik.ops.small_op``, ``kvik_server.app.create_app``):
  the longest importable module prefix is imported and the rest looked up as attributes;
- names qualified by a kvik class (``ModelRunner.launch``, ``Linear.quant_method``): the class has the
  member, as a class attribute, an annotation or an attribute its methods assign
  (``self.quant_method =``);
- the arguments of a call (``create_app(engine_args, settings=None)``): some callable of that name
  takes parameters of those names (arguments that are not plain names are not checked);
- bare CamelCase names (``StepRunner``, ``LLM``), calls (``select_platform(device=None)``) and
  snake_case names (``ops_dispatch``): a class, function, member or field of that name is defined
  somewhere in kvik's packages, or, for snake_case, it is a key of ``kvik env --json``'s report (a
  single lower-case word such as ``name`` is too common to check and is skipped);
- ``kvik::op`` names: the custom op is registered under ``torch.ops.kvik``;
- UPPER_CASE names: an attention backend a plugin registers (``CPU_PAGED``), a module-level name of
  kvik (``PLUGIN_API_VERSION``), or a string the sources use (environment variables such as
  ``KVIK_DEVICE``, also as ``KVIK_PLUGINS=a,b`` or ``$KVIK_CACHE/...``);
- HTTP routes (``/v1/models``): a route of the server's app (``kvik_server.app.create_app``);
- file paths (``kvik/cli/main.py``, ``csrc/paged_attention.cpp``, ``examples/platform-plugin``): some
  file or folder of the repository has that path or ends with it;
- command lines (``kvik env --json``) and flags (``--enforce-eager``): the subcommand exists and its
  parser (or, for a bare flag, some subcommand's parser) knows every flag.

Other spans (single lower-case words, names rooted at a variable or another library such as
``torch.version.hip`` or ``impl.forward``, shapes and expressions) are not kvik names or are not
checkable by name, and are skipped. Python's builtins (``ValueError``) pass, and NOT_KVIK lists
the other names the document uses that kvik does not define (other libraries', hook arguments).
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import inspect
import os
import pkgutil
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("kvik", "kvik_cpu", "kvik_cuda", "kvik_rocm", "kvik_models", "kvik_server")

#: Names in the document that are defined nowhere in kvik: other libraries' (``F`` is
#: ``torch.nn.functional``), and ``register``, the callable each ``kvik_register_*`` hook receives.
NOT_KVIK = frozenset({"ContextVar", "F", "FastAPI", "PluginManager", "register"})

_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")  # may wrap onto the next line, as in Markdown
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_FENCED_PATH = re.compile(r"(?<![\w/.$-])(?:[\w.-]+/)+[\w.-]*|\b[\w-]+\.(?:py|cpp|h|md|toml)\b")
_IDENT = r"[A-Za-z_]\w*"
_DOTTED = re.compile(rf"{_IDENT}(?:\.{_IDENT})+")
_CALL = re.compile(rf"^({_IDENT}(?:\.{_IDENT})*)\((.*)\)$")
_CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*$")
_UPPER = re.compile(r"^[A-Z][A-Z0-9]*_[A-Z0-9_]+$")
_OP = re.compile(rf"^kvik::({_IDENT})")
_ENV = re.compile(r"^\$?([A-Z][A-Z0-9]*_[A-Z0-9_]+)(?:=|/)")  # KVIK_PLUGINS=a,b, $KVIK_CACHE/x
_PATH = re.compile(r"^\.?[\w.-]*(/[\w.-]*)+$|^[\w.-]+\.(py|cpp|h|md|toml)$")
_SKIP_DIRS = {".git", ".nox", "__pycache__", ".venv", "venv", "node_modules", ".pytest_cache"}
#: Folders the build makes (git ignores them): named in the docs, absent from a clean clone.
BUILD_OUTPUTS = {"dist", "build"}


@dataclass
class Names:
    """What the document names, by kind."""

    dotted: set[str] = field(default_factory=set)
    bare: set[str] = field(default_factory=set)
    snake: set[str] = field(default_factory=set)  # bare snake_case names: also env's JSON keys
    ops: set[str] = field(default_factory=set)
    upper: set[str] = field(default_factory=set)
    paths: set[str] = field(default_factory=set)
    routes: set[str] = field(default_factory=set)
    commands: set[str] = field(default_factory=set)  # "kvik env --json", "--enforce-eager"
    calls: set[tuple[str, tuple[str, ...]]] = field(default_factory=set)  # (name, argument names)


def extract(markdown: str) -> Names:
    names = Names()
    for lang, body in _FENCE.findall(markdown):
        if not lang:
            names.paths.update(p.rstrip("/") for p in _FENCED_PATH.findall(body))
    prose = _FENCE.sub("", markdown)
    for span in _SPAN.findall(prose):
        if "\n\n" not in span:  # a blank line ends a paragraph, and a code span with it
            _classify(" ".join(span.split()), names)
    return names


def _classify(span: str, names: Names) -> None:
    if span.startswith(("--", "kvik ")):
        names.commands.add(span)
    elif match := _OP.match(span):
        names.ops.add(match.group(1))
    elif span.startswith("/") and " " not in span:
        names.routes.add(span)
    elif match := _ENV.match(span):
        names.upper.add(match.group(1))
    elif span.startswith(("$", '"', "'")) or " " in span and not _CALL.match(span):
        return  # an environment path, a string literal, an expression or a shape
    elif _PATH.match(span):
        names.paths.add(span.rstrip("/"))
    elif match := _CALL.match(span):
        _classify_name(match.group(1), names, call=True)
        arguments = [a.split("=")[0].strip() for a in match.group(2).split(",") if a.strip()]
        if all(a.isidentifier() for a in arguments):
            names.calls.add((match.group(1), tuple(arguments)))
    else:
        _classify_name(span, names)


def _classify_name(name: str, names: Names, call: bool = False) -> None:
    root = name.split(".")[0]
    if root in PACKAGES or "." in name and _DOTTED.fullmatch(name) and _is_kvik_camel(root):
        names.dotted.add(name)
    elif _UPPER.match(name):
        names.upper.add(name)
    elif re.fullmatch(_IDENT, name) and (_is_kvik_camel(name) or call and _is_kvik_call(name)):
        names.bare.add(name)
    elif re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", name) and _is_kvik_call(name):
        names.snake.add(name)


def _is_kvik_call(name: str) -> bool:
    return name.islower() and name not in NOT_KVIK and not hasattr(builtins, name)


def _is_kvik_camel(name: str) -> bool:
    return bool(_CAMEL.match(name)) and name not in NOT_KVIK and not hasattr(builtins, name)


# --- what exists ------------------------------------------------------------------------------


@cache
def kvik_modules() -> tuple:
    modules = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            if not info.name.endswith("__main__"):  # python -m kvik would run the CLI
                modules.append(importlib.import_module(info.name))
    return tuple(modules)


@cache
def defined() -> dict[str, list]:
    """Name -> the kvik classes, functions and module-level values of that name; also every member
    name of a kvik class, mapped to its classes."""
    index: dict[str, list] = {}
    for module in kvik_modules():
        for name, obj in vars(module).items():
            if inspect.ismodule(obj) or _defined_elsewhere(obj, module.__name__):
                continue  # imported, not defined here
            index.setdefault(name, []).append(obj)
            if inspect.isclass(obj):
                for member in _members(obj):
                    index.setdefault(member, []).append(obj)
    return index


def _defined_elsewhere(obj: object, module_name: str) -> bool:
    """A class or function whose home is another module (values, such as custom ops, count where
    they are assigned)."""
    routine = inspect.isclass(obj) or inspect.isfunction(obj)
    return routine and getattr(obj, "__module__", module_name) != module_name


def _members(cls: type) -> set[str]:
    """Class attributes, annotations and attributes assigned as ``self.x`` in the class's code."""
    members: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        members.update(vars(klass))
        members.update(getattr(klass, "__annotations__", {}))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        members.update(re.findall(rf"\bself\.({_IDENT})\s*(?::[^=\n]+)?=[^=]", source))
    return members


def dotted_objects(name: str) -> list:
    """What a dotted name refers to (None for an attribute only instances have); [] if nothing."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:  # Class.member
        classes = [c for c in defined().get(parts[0], []) if inspect.isclass(c)]
        owners = [c for c in classes if len(parts) == 2 and parts[1] in _members(c)]
        return [getattr(c, parts[1], None) for c in owners]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:]):
            if not hasattr(obj, attr):
                rest = parts[cut + i :]
                found = inspect.isclass(obj) and len(rest) == 1 and rest[0] in _members(obj)
                return [None] if found else []
            obj = getattr(obj, attr)
        return [obj]
    return []


def bare_objects(name: str) -> list:
    """The kvik objects named ``name``: module-level ones, and members of classes."""
    return [
        getattr(obj, name, None) if inspect.isclass(obj) and obj.__name__ != name else obj
        for obj in defined().get(name, [])
    ]


def takes(objects: list, arguments: tuple[str, ...]) -> bool:
    """Whether one of ``objects`` accepts ``arguments`` by name (or cannot be inspected)."""
    for obj in objects:
        try:
            parameters = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):
            return True  # not a callable whose signature Python knows
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
            return True
        if set(arguments) <= {p.name for p in parameters}:
            return True
    return False


@cache
def repo_paths() -> frozenset[str]:
    paths = set()
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [
            d for d in dirs if d not in _SKIP_DIRS | BUILD_OUTPUTS and not d.endswith(".egg-info")
        ]
        rel = Path(root).relative_to(REPO).as_posix()
        prefix = "" if rel == "." else rel + "/"
        paths.update(prefix + name for name in dirs + files)
    return frozenset(paths)


def path_exists(path: str) -> bool:
    if path.split("/")[0] in BUILD_OUTPUTS:
        return True
    return any(p == path or p.endswith("/" + path) for p in repo_paths())


@cache
def command_flags() -> dict[str, frozenset[str]]:
    """Subcommand path ("env", "bench throughput") -> the option strings its parser accepts."""
    from kvik.cli.main import all_commands, build_parser

    flags: dict[str, frozenset[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        flags[path] = frozenset(s for a in parser._actions for s in a.option_strings)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}".strip())

    for command in all_commands():
        parser = build_parser(command)
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        walk(subparsers.choices[command], command)
    return flags


def command_missing(span: str) -> list[str]:
    """What of a command span (``kvik env --json``, ``--no-async-scheduling``, ``kvik bench
    throughput | latency``: alternatives for the last word) does not exist."""
    known = command_flags()
    first, *alternatives = (part.split() for part in span.split("|"))
    if first[0] != "kvik":
        everywhere = set().union(*known.values())
        return [f for f in first if f.startswith("--") and f.split("=")[0] not in everywhere]
    lines = [first] + [first[:-1] + alternative for alternative in alternatives]
    missing = []
    for words in lines:
        words = [w.strip("[]") for w in words[1:]]
        positional = [w for w in words if not w.startswith("-")]
        path = next(
            (" ".join(positional[:n]) for n in range(len(positional), 0, -1)
             if " ".join(positional[:n]) in known),
            None,
        )  # fmt: skip
        if path is None:
            missing.append("kvik " + " ".join(positional[:1] or words))
            continue
        flags = [w.split("=")[0] for w in words if w.startswith("--")]
        missing += [f"kvik {path} {f}" for f in flags if f not in known[path]]
    return missing


@cache
def registered_backends() -> frozenset[str]:
    from kvik.plugins.manager import get_plugin_manager

    return frozenset(get_plugin_manager().attention_backends.names())


@cache
def env_keys() -> frozenset[str]:
    """Every key of ``kvik env --json``'s report, at any depth."""
    from kvik.cli.env import collect

    keys: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            keys.update(value)
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(collect())
    return frozenset(keys)


@cache
def server_routes() -> frozenset[str]:
    from kvik.engine.args import EngineArgs
    from kvik_server.app import create_app

    app = create_app(EngineArgs())  # the engine starts with the app's lifespan, not here
    return frozenset(route.path for route in app.routes)


@cache
def source_text() -> str:
    roots = [REPO / "packages", REPO / "examples"]
    return "\n".join(p.read_text(errors="replace") for root in roots for p in root.rglob("*.py"))


def missing_names(names: Names) -> list[str]:
    import torch

    import kvik.ops  # noqa: F401  (defines torch.ops.kvik.*)

    missing = [f"module or attribute {n}" for n in sorted(names.dotted) if not dotted_objects(n)]
    missing += [f"name {n}" for n in sorted(names.bare) if n not in defined()]
    missing += [
        f"name {n}" for n in sorted(names.snake) if n not in defined() and n not in env_keys()
    ]
    missing += [f"op kvik::{n}" for n in sorted(names.ops) if not hasattr(torch.ops.kvik, n)]
    for name in sorted(names.upper):
        known = name in registered_backends() or name in defined()
        if not known and f'"{name}"' not in source_text():
            missing.append(f"backend, constant or environment variable {name}")
    missing += [f"path {p}" for p in sorted(names.paths) if not path_exists(p)]
    missing += [f"route {r}" for r in sorted(names.routes) if r not in server_routes()]
    for name, arguments in sorted(names.calls):
        if name in NOT_KVIK:
            continue
        objects = dotted_objects(name) if "." in name else bare_objects(name)
        if objects and not takes(objects, arguments):
            missing.append(f"parameters {name}({', '.join(arguments)})")
    for span in sorted(names.commands):
        missing += [f"command {m} (in `{span}`)" for m in command_missing(span)]
    return missing


# --- tests ------------------------------------------------------------------------------------


def test_every_name_in_architecture_md_exists():
    names = extract(DOC.read_text())
    # The extraction finds the document's names at all (a broken pattern would pass vacuously).
    assert {"kvik.ops.small_op", "ModelRunner.launch"} <= names.dotted
    assert {"StepRunner", "select_platform"} <= names.bare
    assert "kvik/plugins/hookspecs.py" in names.paths and "CPU_PAGED" in names.upper
    assert "--enforce-eager" in names.commands and "unified_attention" in names.ops
    missing = missing_names(names)
    assert not missing, "docs/architecture.md names what does not exist:\n  " + "\n  ".join(missing)


def test_missing_names_are_reported():
    doc = """
A `kvik.ops.no_such_op`, a `kvik_nothing.module` (not a kvik package: skipped), a method
`ModelRunner.no_such_method`, a class `NoSuchRunner`, a call `no_such_function(x)`, an op
`kvik::no_such_op`, a backend `NO_SUCH_ATTN`, a variable `KVIK_NO_SUCH_VAR`, a file
`kvik/no_such_file.py`, a route `/v1/no_such_route`, a flag `--no-such-flag`, a command
`kvik no-such-command`, a flag of the wrong command `kvik env --enforce-eager`, and real ones:
`kvik.ops`, `kvik_models`, `Linear.quant_method`, `kvik bench throughput | latency --output-json`,
`--device`, `TORCH_SDPA`, `KVIK_DEVICE`, `KVIK_PLUGINS=a,b`, `noxfile.py`, `/v1/models`,
`is_present()`, `LLM`, `LMHead.quant_method`, `ops_dispatch`, `selection_error`, and what is not checked:
`torch.compile`, `ValueError`, `len(x)`, `FastAPI`, `name`. Wrong ones again: a field `no_such_field`,
a stale signature `kvik_server.app.create_app(async_llm)`, a class `NOSUCHCLASS`, a variable `$KVIK_NO_SUCH_CACHE/x`, a member `Platform.no_such_member`, a
command that wraps onto the next line `kvik env
--no-such-wrapped-flag`.

```
packages/core/src/kvik/no_such_module.py   a listing
```
"""
    missing = missing_names(extract(doc))
    assert missing == [
        "module or attribute ModelRunner.no_such_method",
        "module or attribute Platform.no_such_member",
        "module or attribute kvik.ops.no_such_op",
        "name NOSUCHCLASS",
        "name NoSuchRunner",
        "name no_such_function",
        "name no_such_field",
        "op kvik::no_such_op",
        "backend, constant or environment variable KVIK_NO_SUCH_CACHE",
        "backend, constant or environment variable KVIK_NO_SUCH_VAR",
        "backend, constant or environment variable NO_SUCH_ATTN",
        "path kvik/no_such_file.py",
        "path packages/core/src/kvik/no_such_module.py",
        "route /v1/no_such_route",
        "parameters kvik_server.app.create_app(async_llm)",
        "command --no-such-flag (in `--no-such-flag`)",
        "command kvik env --enforce-eager (in `kvik env --enforce-eager`)",
        "command kvik env --no-such-wrapped-flag (in `kvik env --no-such-wrapped-flag`)",
        "command kvik no-such-command (in `kvik no-such-command`)",
    ]
