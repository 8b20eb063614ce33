"""The xgrammar calls: compiling a request's ``StructuredOutputsParams`` and checking one.

xgrammar is imported here only, and only when a request asks for structured outputs: importing it
takes seconds, which an engine without such requests should not pay.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvik.sampling_params import StructuredOutputsParams

#: What an OpenAI ``json_object`` response format allows: any JSON object.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
#: The longest run of whitespace allowed between JSON tokens. Unbounded, a sampled model can
#: loop on newlines and indentation until max_tokens; deeply indented JSON still fits.
MAX_JSON_WHITESPACE = 32


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str, bool]:
    """The cache key of a constraint: its kind, its text in a canonical form, the whitespace rule."""
    kind = params.kind
    if kind == "json":
        spec = params.json
        if isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True)
        else:
            spec = json.dumps(_parse_schema_text(spec), sort_keys=True)
    elif kind == "json_object":
        spec = _ANY_OBJECT_SCHEMA
    elif kind == "choice":
        spec = json.dumps(params.choice)
    else:
        spec = getattr(params, kind)
    return kind, spec, params.disable_any_whitespace


def _parse_schema_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    # JSON string escapes are the escapes xgrammar's EBNF string literals read.
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alternatives}"


#: The log prefix of xgrammar's errors ("[22:38:43] /project/cpp/json_schema_converter.cc:5082: "):
#: its clock and C++ source, nothing a client can act on.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:.]+\] \S+:\d+: ")


def _reason(error: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(error)).strip()


def compile_grammar(compiler: Any, key: tuple[str, str, bool]) -> Any:
    """An ``xgrammar.CompiledGrammar`` for a ``grammar_key``; raises ValueError with xgrammar's
    message when the schema, regex or grammar is not valid."""
    kind, spec, disable_any_whitespace = key
    try:
        if kind in ("json", "json_object"):
            return compiler.compile_json_schema(
                spec,
                any_whitespace=not disable_any_whitespace,
                max_whitespace_cnt=MAX_JSON_WHITESPACE,
            )
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec)))
        return compiler.compile_grammar(spec)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"invalid structured_outputs.{kind}: {_reason(e)}") from None


#: JSON-schema validation keywords xgrammar 0.2 compiles without enforcing: probed one by one on a
#: document that breaks each, its grammar accepted it (``not``, ``if``/``then``/``else``,
#: ``dependentRequired``, ``dependentSchemas``; ``uniqueItems: true``; ``allOf`` of two or more
#: schemas, of which it follows one). A schema that uses one is refused, as vLLM refuses schemas
#: its xgrammar backend cannot follow, rather than served output that may break it.
_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")
#: Where a schema holds subschemas: maps of them, lists of them, one (or a list, for "items").
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = (
    "additionalProperties", "items", "additionalItems", "contains", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else",
)  # fmt: skip


def unenforced_schema_keywords(schema: Any, path: str = "#") -> list[str]:
    """The keywords of a JSON schema (and of its subschemas, not of its data: property names,
    enum and const values, defaults) that xgrammar would not enforce, each with its JSON
    pointer, e.g. ``'not' at #/properties/a``."""
    if not isinstance(schema, dict):
        return []
    found = [f"{key!r} at {path}" for key in _UNENFORCED if key in schema]
    if schema.get("uniqueItems") is True:
        found.append(f"'uniqueItems' at {path}")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        found.append(f"'allOf' of {len(all_of)} schemas at {path}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unenforced_schema_keywords(sub, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                found += unenforced_schema_keywords(sub, f"{path}/{key}/{i}")
    for key in _SUBSCHEMAS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, item in enumerate(sub):
                found += unenforced_schema_keywords(item, f"{path}/{key}/{i}")
        else:
            found += unenforced_schema_keywords(sub, f"{path}/{key}")
    return found


def check_grammar(params: StructuredOutputsParams, where: str | None = None) -> None:
    """Parse the constraint without a tokenizer (cheap), so that a bad schema, regex or grammar is
    a ValueError in the front end rather than a failed request in the engine core. ``where``
    names the constraint in the message (default ``structured_outputs.<kind>``): a server names
    the request field it came from."""
    import xgrammar as xgr

    kind, spec, disable_any_whitespace = grammar_key(params)
    if kind == "json":
        unenforced = unenforced_schema_keywords(json.loads(spec))
        if unenforced:
            raise ValueError(
                f"invalid {where or 'structured_outputs.json'}: the schema uses keywords the "
                f"grammar engine (xgrammar) does not enforce: {', '.join(unenforced)}; outputs "
                "would not be held to them, so the schema is refused"
            )
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(
                spec,
                any_whitespace=not disable_any_whitespace,
                max_whitespace_cnt=MAX_JSON_WHITESPACE,
            )
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
        else:
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"invalid {where or 'structured_outputs.' + kind}: {_reason(e)}") from None


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary. ``vocab_size`` is the model's (the logits' width), which
    may exceed the tokenizer's: xgrammar then masks the ids past the tokenizer's vocabulary."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
    )
