"""A request's ``tools`` and ``tool_choice``: checked, and turned into what the engine and the
output parsing need (a JSON schema that constrains generation, or the parser that reads calls).

vLLM's rules: ``tools`` are function tools; ``tool_choice`` is ``none``, ``auto`` (the default when
tools are given, and only with ``--enable-auto-tool-choice`` and a ``--tool-call-parser``),
``required`` (the output is constrained to a JSON array of calls) or a named function (the
output is constrained to that function's arguments).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvik.sampling_params import SamplingParams, StructuredOutputsParams
from kvik_server.errors import APIError
from kvik_server.structured_outputs import check_schema
from kvik_server.tools.parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolsParser,
    ToolParser,
)

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
#: The schema of a function that declares no parameters: any object.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolOptions:
    """The server's tool flags: ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r}; "
                f"kvik has {', '.join(TOOL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs a --tool-call-parser")


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None = None

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates (and OpenAI's request) know it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def function_tool(entry: Any, where: str, nested: bool = True) -> FunctionTool:
    """One tool of a request: ``{"type": "function", "function": {...}}`` in chat completions,
    ``{"type": "function", "name": ...}`` (``nested=False``) in responses."""
    if not isinstance(entry, dict):
        raise APIError(f"{where} must be an object", param=where)
    if entry.get("type") != "function":
        raise APIError(
            f"{where}.type must be 'function' (the only tools kvik runs), got {entry.get('type')!r}",
            param=f"{where}.type",
        )
    body = entry.get("function") if nested else entry
    body_where = f"{where}.function" if nested else where
    if not isinstance(body, dict):
        raise APIError(f"{body_where} must be an object", param=body_where)
    name = body.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(
            f"{body_where}.name must be 1 to 128 letters, digits, '_', '-', '.' or ':', "
            f"got {name!r}",
            param=f"{body_where}.name",
        )
    description = body.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(f"{body_where}.description must be a string", param=body_where)
    parameters = body.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(
            f"{body_where}.parameters must be a JSON schema object",
            param=f"{body_where}.parameters",
        )
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(f"{body_where}.strict must be a bool", param=f"{body_where}.strict")
    return FunctionTool(name, description, parameters, strict)


def parse_tools(tools: list[Any] | None, nested: bool = True) -> list[FunctionTool]:
    result = [function_tool(entry, f"tools[{i}]", nested) for i, entry in enumerate(tools or [])]
    names = [tool.name for tool in result]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise APIError(f"tools has more than one function named {duplicates}", param="tools")
    return result


@dataclass
class ToolPlan:
    """How a request uses its tools: ``mode`` is none, auto, required or named."""

    tools: list[FunctionTool]
    mode: str
    function: str | None = None
    parallel_tool_calls: bool = True
    auto_parser: type[ToolParser] | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.as_openai() for tool in self.tools] or None

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes the output a call: the ``required`` array, or the named
        function's arguments."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.function)
            return StructuredOutputsParams(json=tool.parameters or _ANY_OBJECT)
        if self.mode == "required":
            return StructuredOutputsParams(
                json=required_schema(self.tools, self.parallel_tool_calls)
            )
        return None

    def parser(self) -> ToolParser | None:
        """What reads calls out of the output (None: the output is all answer)."""
        if self.mode == "named":
            return NamedToolParser(self.function or "")
        if self.mode == "required":
            return RequiredToolsParser()
        if self.mode == "auto" and self.auto_parser is not None:
            return self.auto_parser()
        return None


def required_schema(tools: list[FunctionTool], parallel_tool_calls: bool) -> dict[str, Any]:
    """A JSON array of one or more ``{"name": <a tool>, "parameters": <its arguments>}``."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.name]},
                        "parameters": tool.parameters or _ANY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                }
                for tool in tools
            ],
        },
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def plan_tools(
    tools: list[FunctionTool],
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    nested_choice: bool = True,
) -> ToolPlan:
    """Check ``tool_choice`` against the tools and the server's flags. ``nested_choice``: a named
    choice is ``{"type": "function", "function": {"name": ...}}`` (chat completions) rather than
    ``{"type": "function", "name": ...}`` (responses)."""
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls must be a bool", param="parallel_tool_calls")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(
                "tool_choice must be 'none', 'auto', 'required' or a named function, "
                f"got {tool_choice!r}",
                param="tool_choice",
            )
        if tool_choice != "none" and not tools:
            raise APIError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        if tool_choice == "auto" and not (enable_auto_tool_choice and tool_call_parser):
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        if tool_choice == "required":
            _check_parameters(tools, {tool.name for tool in tools}, nested_choice)
        auto_parser = TOOL_PARSERS[tool_call_parser] if tool_call_parser else None
        return ToolPlan(tools, tool_choice, None, parallel, auto_parser)
    name = _named_choice(tool_choice, nested_choice)
    if name not in {tool.name for tool in tools}:
        raise APIError(
            f"tool_choice names the function {name!r}, which is not in tools "
            f"({', '.join(tool.name for tool in tools) or 'none given'})",
            param="tool_choice",
        )
    _check_parameters(tools, {name}, nested_choice)
    return ToolPlan(tools, "named", name, parallel)


def _check_parameters(tools: list[FunctionTool], names: set[str], nested: bool) -> None:
    """The parameters that will constrain the output (required, or a named function) parse as
    a schema: a 400 naming the tool (it said "invalid structured_outputs.json"). Those of tools
    that only reach the template (auto, none) are the template's business."""
    for i, tool in enumerate(tools):
        if tool.name in names and tool.parameters is not None:
            where = f"tools[{i}].function.parameters" if nested else f"tools[{i}].parameters"
            check_schema(tool.parameters, where, where)


def _named_choice(tool_choice: Any, nested: bool) -> str | None:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        body = tool_choice.get("function") if nested else tool_choice
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            return body["name"]
    shape = (
        '{"type": "function", "function": {"name": ...}}'
        if nested
        else '{"type": "function", "name": ...}'
    )
    raise APIError(
        f"tool_choice must be 'none', 'auto', 'required' or {shape}, got {tool_choice!r}",
        param="tool_choice",
    )


def apply_tool_plan(params: SamplingParams, plan: ToolPlan) -> None:
    """Constrain the request as its tool_choice says, and keep the special tokens its parser
    reads."""
    constraint = plan.constraint()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(
                f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined "
                "with response_format or structured_outputs",
                param="tool_choice",
            )
        params.structured_outputs = constraint
    parser = plan.parser()
    if parser is not None and parser.keeps_special_tokens:
        params.skip_special_tokens = False
