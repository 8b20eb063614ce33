"""Twenty JSON schemas of the shapes structured-output users send: nested objects, arrays with
bounds, enums, required fields, bounded numbers, strings with patterns and lengths, nullable
fields. Strings are bounded so that a sampled answer ends within a test's token budget; a string with a pattern carries its length in the pattern (xgrammar
reads a pattern alone, without minLength/maxLength)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "name": NAME,
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"nickname": {"anyOf": [NAME, {"type": "null"}]}},
        "required": ["nickname"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "active": {"type": "boolean"},
            "count": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["active", "count"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 2,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "array",
                "items": {"type": "number", "minimum": -10, "maximum": 10},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "message": {"type": ["string", "null"], "maxLength": 12},
        },
        "required": ["status", "message"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[a-z]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {"enum": ["small", "medium", "large"]},
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -40, "maximum": 50},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["temperature", "unit"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 5}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "words": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                "maxItems": 3,
            }
        },
        "required": ["words"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
            "comment": {"type": "string", "maxLength": 20},
        },
        "required": ["rating"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[0-9a-f]{8}$"},
            "parent": {"anyOf": [{"type": "string", "pattern": "^[0-9a-f]{8}$"}, {"type": "null"}]},
            "depth": {"type": "integer", "minimum": 0, "maximum": 3},
        },
        "required": ["id", "parent", "depth"],
        "additionalProperties": False,
    },
]
