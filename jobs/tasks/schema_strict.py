"""Strict JSON schemas: no keys beyond an object's `properties` unless the schema says so.

JSON Schema lets an object without `additionalProperties` hold any other key, so a constrained
model may add keys the caller never asked for. xgrammar's strict mode and OpenAI's strict
structured outputs close every object instead; `strict_schema` does the same before a schema is
compiled: each object schema (`type: object`, or one with `properties`) that gives neither
`additionalProperties` nor `unevaluatedProperties` gets `additionalProperties: false`, at every
nesting level (properties, items, anyOf / oneOf branches, $defs, ...). The members of an `allOf`
are left open: each would refuse the keys of the others. Opt out per job with
`sampling.json_schema_strict: false`, per OpenAI batch line with `response_format.json_schema.strict:
false`.
"""
from __future__ import annotations

import json
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "unevaluatedProperties", "items", "contains", "not", "if", "then", "else",
            "additionalItems", "unevaluatedItems", "propertyNames")


def _is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def strict_schema(schema: Any, closed: bool = True) -> Any:
    """A copy of `schema` with every open object closed (see the module docstring); `closed=False`
    leaves this level's own object open (an allOf member) and still closes the ones below it."""
    if isinstance(schema, list):  # `items` as a list (draft 4-2019)
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):  # true / false schemas, and values that are not schemas
        return schema
    result = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: strict_schema(sub) for name, sub in result[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(result.get(key), list):
            result[key] = [strict_schema(sub) for sub in result[key]]
    if isinstance(result.get("allOf"), list):
        result["allOf"] = [strict_schema(sub, closed=False) for sub in result["allOf"]]
    for key in _SCHEMAS:
        if key in result:
            result[key] = strict_schema(result[key])
    if closed and _is_object_schema(result) and "additionalProperties" not in result \
            and "unevaluatedProperties" not in result:
        result["additionalProperties"] = False
    return result


def strict_schema_text(text: str) -> str:
    """`strict_schema` of a schema given as JSON text (key order kept: it is the generation order).
    Text that is not JSON is returned as it is, for the compiler to say what is wrong with it."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(strict_schema(schema))
