"""A request's structured-output constraint: OpenAI's ``response_format`` or vLLM's extra
``structured_outputs`` body field, as the engine's ``StructuredOutputsParams``.

Only the shape is checked here; whether the schema, regex or grammar parses is checked by the
engine's input processor (kvik.structured_output.grammar), whose ValueError is a 400 carrying the
parser's message. A schema from another field (response_format, a Responses text.format, a tool's
parameters) is parsed here too, with ``check_schema``, so that the 400 names that field rather than
the structured_outputs the request does not have.
"""

from __future__ import annotations

from typing import Any

from kvik.sampling_params import StructuredOutputsParams
from kvik_server.errors import APIError

_STRUCTURED_OUTPUTS_KEYS = (
    "json",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "disable_any_whitespace",
)


#: vLLM's old fields (removed there in favour of ``structured_outputs``) and their new keys.
OLD_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def refuse_old_guided_fields(request: Any) -> None:
    """A request with vLLM's old ``guided_*`` fields is refused: ignored, like any unknown field,
    its output was silently unconstrained."""
    for name, key in OLD_GUIDED_FIELDS.items():
        if getattr(request, name, None) is not None:
            raise APIError(
                f"{name} is not supported (vLLM's old field); give structured_outputs "
                f'{{"{key}": ...}} or response_format instead',
                param=name,
            )


def structured_outputs_params(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutputsParams | None:
    from_format = _from_response_format(response_format)
    from_extra = _from_structured_outputs(structured_outputs)
    if from_format is not None and from_extra is not None:
        raise APIError(
            "give either response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    return from_format if from_format is not None else from_extra


def _from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(
                "response_format of type json_schema needs a json_schema object",
                param="response_format",
            )
        schema = spec.get("schema")
        if schema is None:
            # OpenAI's schema is optional: without one, any JSON object.
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise APIError(
                "response_format.json_schema.schema must be a JSON object", param="response_format"
            )
        # "strict" is always honoured: the grammar is the schema, so outputs always follow it.
        return check_schema(schema, "response_format.json_schema.schema", "response_format")
    raise APIError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def check_schema(schema: dict[str, Any], where: str, param: str) -> StructuredOutputsParams:
    """The constraint of a JSON schema that the request's ``where`` holds; a 400 naming it when
    the schema does not parse (it said "invalid structured_outputs.json")."""
    from kvik.structured_output.grammar import check_grammar

    params = StructuredOutputsParams(json=schema)
    try:
        check_grammar(params, where)
    except ValueError as e:
        raise APIError(str(e), param=param) from None
    return params


def _from_structured_outputs(fields: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fields is None:
        return None
    unknown = sorted(set(fields) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise APIError(
            f"structured_outputs has unknown keys {unknown}; it takes "
            f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}",
            param="structured_outputs",
        )
    given = {key: value for key, value in fields.items() if value is not None}
    try:
        return StructuredOutputsParams(**given)
    except ValueError as e:
        raise APIError(str(e), param="structured_outputs") from None
