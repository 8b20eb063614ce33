"""Tool-call and reasoning parsers on fixed texts, whole and streamed: streamed in every split of
the text into steps, the deltas must assemble (as the openai client does) into the whole answer."""

from __future__ import annotations

import json
import random
from functools import partial

import pytest

from kvik_server.errors import APIError
from kvik_server.output_parsing import OutputParser
from kvik_server.reasoning.parsers import REASONING_PARSERS
from kvik_server.tools.choice import parse_tools, plan_tools, required_schema
from kvik_server.tools.json_scan import read_partial_object, value_end
from kvik_server.tools.parsers import TOOL_PARSERS, NamedToolParser, RequiredToolsParser

WEATHER = '{"city": "Paris", "units": ["c", {"x": "}\\""}]}'
TIME = '{"zone": "UTC"}'


def assemble(parser: OutputParser, text: str, seed: int) -> dict:
    """Stream ``text`` in random pieces and merge the deltas the way the openai client does."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    result = {"reasoning": "", "content": "", "calls": []}
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        result["reasoning"] += delta.reasoning
        result["content"] += delta.content
        for call in delta.tool_calls:
            if "id" in call:
                assert call["index"] == len(result["calls"])
                assert call["function"]["arguments"] == ""
                result["calls"].append({"id": call["id"], "name": call["function"]["name"]})
                result["calls"][-1]["arguments"] = ""
            else:
                assert set(call) == {"index", "function"}
                result["calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return result


def check_both(make, text: str, content, calls, reasoning=None) -> None:
    """The whole parse and every streamed parse give ``content`` and ``calls`` [(name, args)]."""
    whole = make().parse(text)
    assert whole.content == content
    assert whole.reasoning == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    for seed in range(25):
        streamed = assemble(make(), text, seed)
        assert streamed["content"] == (content or "")
        assert streamed["reasoning"] == (reasoning or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == calls
        # What streamed is the raw arguments text: the same as the whole parse's.
        assert [c["arguments"] for c in streamed["calls"]] == [
            c.arguments for c in whole.tool_calls
        ]


def tool_parser(name: str, **kw):
    return lambda: OutputParser(tools=TOOL_PARSERS[name](), **kw)


def test_json_scan():
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end('{"a": [1, 2', 0) is None
    assert value_end("12,", 0) == 2 and value_end("12", 0) is None
    obj = read_partial_object('{"name": "f", "arguments": {"x": 1', 0)
    assert obj.members == {"name": "f"} and obj.open_key == "arguments"
    assert obj.open_raw == '{"x": 1' and obj.end is None
    assert read_partial_object("{1: 2}", 0).invalid


def test_hermes():
    one = f'<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>'
    two = f'<tool_call>{{"name": "time", "arguments": {TIME}}}</tool_call>'
    make = tool_parser("hermes")
    check_both(make, "Let me look. " + one, "Let me look. ", [("weather", json.loads(WEATHER))])
    check_both(
        make, one + "\n" + two, None, [("weather", json.loads(WEATHER)), ("time", {"zone": "UTC"})]
    )
    check_both(make, "No <tool and no call.", "No <tool and no call.", [])
    # Unreadable calls are plain text, as in vLLM.
    broken = '<tool_call>{"name": "weather", "arguments": {"city": </tool_call>'
    assert make().parse(broken).content == broken and not make().parse(broken).tool_calls
    assert make().parse("<tool_call>not json</tool_call>").tool_calls == []
    # parallel_tool_calls=False keeps the first call.
    first_only = tool_parser("hermes", parallel_tool_calls=False)
    check_both(first_only, one + two, None, [("weather", json.loads(WEATHER))])


def test_llama3_json():
    make = tool_parser("llama3_json")
    text = (
        f'{{"name": "weather", "parameters": {WEATHER}}}; {{"name": "time", "parameters": {TIME}}}'
    )
    check_both(make, text, None, [("weather", json.loads(WEATHER)), ("time", {"zone": "UTC"})])
    check_both(
        make, "<|python_tag|>" + text[: text.index(";")], None, [("weather", json.loads(WEATHER))]
    )
    check_both(make, "Paris is in France.", "Paris is in France.", [])
    check_both(make, '{"answer": 42}', '{"answer": 42}', [])


def test_mistral_keeps_special_tokens():
    assert TOOL_PARSERS["mistral"].keeps_special_tokens
    make = tool_parser("mistral")
    text = f'Sure.[TOOL_CALLS] [{{"name": "weather", "arguments": {WEATHER}}}, {{"name": "time", "arguments": {TIME}}}]'
    check_both(make, text, "Sure.", [("weather", json.loads(WEATHER)), ("time", {"zone": "UTC"})])
    check_both(make, "[TOOL plus text", "[TOOL plus text", [])


def test_constrained_outputs():
    required = partial(OutputParser, tools=RequiredToolsParser())
    text = f'[{{"name": "weather", "parameters": {WEATHER}}}, {{"name": "time", "parameters": {TIME}}}]'
    check_both(required, text, None, [("weather", json.loads(WEATHER)), ("time", {"zone": "UTC"})])
    named = partial(OutputParser, tools=NamedToolParser("weather"))
    check_both(named, WEATHER, None, [("weather", json.loads(WEATHER))])
    # Output the grammar did not shape (cut short, or no grammar) stays text.
    assert named().parse('{"city": "Pa').content == '{"city": "Pa'


def test_reasoning():
    r1 = partial(OutputParser, reasoning=REASONING_PARSERS["deepseek_r1"]())
    check_both(r1, "Think hard.</think>\n\nThe answer.", "The answer.", [], "Think hard.")
    check_both(r1, "<think>Still thinking", None, [], "Still thinking")
    qwen3 = partial(OutputParser, reasoning=REASONING_PARSERS["qwen3"]())
    check_both(qwen3, "<think>\nHmm.\n</think>\n\nHi!", "Hi!", [], "\nHmm.\n")
    check_both(qwen3, "Hi <there>!", "Hi <there>!", [], None)
    opened = partial(
        OutputParser, reasoning=REASONING_PARSERS["qwen3"]("<|im_start|>assistant\n<think>\n")
    )
    check_both(opened, "Hmm.</think>Hi!", "Hi!", [], "Hmm.")
    # Reasoning, then a call in what follows it.
    both = partial(OutputParser, REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"]())
    text = f'<think>Need weather.</think>\n<tool_call>{{"name": "weather", "arguments": {WEATHER}}}</tool_call>'
    check_both(both, text, None, [("weather", json.loads(WEATHER))], "Need weather.")


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_after_whitespace_streamed_alone(name):
    """Whitespace before ``<think>`` in a step of its own: it was sent at once (as content for
    Qwen3, as reasoning for DeepSeek-R1), and the text the whole parse gives lost its first
    character once ``<think>`` came ("Hi!" streamed as " i!")."""
    text = "\n<think>Hmm.</think>Hi!"
    whole = OutputParser(reasoning=REASONING_PARSERS[name]()).parse(text)
    assert (whole.reasoning, whole.content) == ("Hmm.", "Hi!")
    parser = OutputParser(reasoning=REASONING_PARSERS[name]())
    deltas = [parser.feed(piece) for piece in ("\n", "<think>Hmm.", "</think>Hi!")]
    deltas.append(parser.finish())
    assert "".join(d.reasoning for d in deltas) == "Hmm."
    assert "".join(d.content for d in deltas) == "Hi!"


TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "time"}},
]


def test_tool_choice_rules():
    tools = parse_tools(TOOLS)
    named = {"type": "function", "function": {"name": "time"}}
    plan = plan_tools(tools, named, None, False, None)
    assert plan.mode == "named" and plan.constraint().json == {"type": "object"}
    plan = plan_tools(tools, "required", False, False, None)
    assert plan.constraint().json == required_schema(tools, False)
    assert plan.constraint().json["maxItems"] == 1
    assert plan_tools(tools, "none", None, False, None).parser() is None
    assert plan_tools([], None, None, False, None).mode == "none"
    assert plan_tools(tools, None, None, True, "hermes").mode == "auto"
    bad = [
        (tools, None, False, None, "--enable-auto-tool-choice"),
        (tools, "auto", False, None, "--enable-auto-tool-choice"),
        (tools, {"type": "function", "function": {"name": "nope"}}, True, "hermes", "not in tools"),
        ([], "required", True, "hermes", "needs tools"),
        (tools, "always", True, "hermes", "tool_choice must be"),
        (tools, {"name": "time"}, True, "hermes", "tool_choice must be"),
    ]
    for tools_, choice, auto, parser, message in bad:
        with pytest.raises(APIError, match=message) as e:
            plan_tools(tools_, choice, None, auto, parser)
        assert e.value.status == 400
    for entry, message in [
        ({"type": "code_interpreter"}, "must be 'function'"),
        ({"type": "function", "function": {"name": "a b"}}, "name must be"),
        ({"type": "function", "function": {"name": "f", "parameters": []}}, "parameters"),
    ]:
        with pytest.raises(APIError, match=message):
            parse_tools([entry])
    with pytest.raises(APIError, match="more than one"):
        parse_tools([TOOLS[0], TOOLS[0]])


def test_a_constraining_tools_bad_schema_is_named():
    """A schema xgrammar cannot follow was a 400 about structured_outputs (a field the request
    did not have) with xgrammar's C++ source in it; now it names the tool's parameters. A tool the
    output is not constrained by (auto, none) only reaches the template, and is left alone."""
    good = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    tools = parse_tools([good, bad])
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError) as e:
            plan_tools(tools, choice, None, False, None)
        assert e.value.param == "tools[1].function.parameters"
        assert e.value.message == 'invalid tools[1].function.parameters: Unsupported type "bogus"'
    plan_tools(tools, {"type": "function", "function": {"name": "ok"}}, None, False, None)
    plan_tools(tools, "none", None, False, None)
    assert plan_tools(tools, "auto", None, True, "hermes").mode == "auto"
    responses = parse_tools([bad["function"] | {"type": "function"}], nested=False)
    with pytest.raises(APIError, match=r"tools\[0\]\.parameters: Unsupported"):
        plan_tools(responses, "required", None, False, None, nested_choice=False)


def test_a_response_formats_bad_schema_is_named():
    from kvik_server.responses.items import text_format
    from kvik_server.structured_outputs import structured_outputs_params

    schema = {"type": "integer", "minimum": 5, "maximum": 1}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(APIError) as e:
        structured_outputs_params(fmt, None)
    assert e.value.param == "response_format"
    assert e.value.message.startswith("invalid response_format.json_schema.schema: Invalid range")
    with pytest.raises(APIError, match="invalid text.format.schema: Invalid range"):
        text_format({"format": {"type": "json_schema", "name": "x", "schema": schema}})
