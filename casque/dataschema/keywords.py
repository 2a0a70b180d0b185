"""The JSON Schema keywords a queue schema may use, and the check that it uses no others.

Schemas are JSON Schema draft 2020-12, checked by fastjsonschema (validation.py), which
implements drafts 4, 6 and 7. The keywords below mean the same in draft 7 and 2020-12, so a
schema made only of them is checked by draft-7 code exactly as 2020-12 says. Keywords that
2020-12 added or changed (`prefixItems`, `items` as an array, `dependentRequired`,
`dependentSchemas`, `unevaluatedProperties`, `unevaluatedItems`, `minContains`,
`maxContains`, `$anchor`, `$dynamicRef`, ...) would be ignored by draft-7 code, letting
through messages the schema refuses: a schema that uses one is refused instead, as is a
keyword nobody knows (a misspelt `requried` must not silently check nothing).

`$ref` may point only inside the schema (`#/$defs/...`): a schema that names another
document would make the operator and every sidecar fetch it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"

# Say something about a message without constraining it. `format` is an annotation too: in
# 2020-12 it asserts nothing unless a vocabulary says so, and casque does not.
ANNOTATIONS = frozenset({
    "$schema", "$id", "$comment", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "format", "contentMediaType", "contentEncoding",
})
# Keywords whose value is one subschema, a map of names to subschemas, or a list of them.
ONE_SUBSCHEMA = frozenset({"additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else"})
SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs"})
SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf"})
# Constrain the value itself.
ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxProperties",
    "minProperties", "required", "$ref",
})
SUPPORTED = ANNOTATIONS | ONE_SUBSCHEMA | SUBSCHEMA_MAPS | SUBSCHEMA_LISTS | ASSERTIONS


def pointer(parts: tuple[str, ...]) -> str:
    """A JSON pointer (RFC 6901) to a place in a document."""
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in parts)


def subschemas(schema: dict[str, Any], at: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every subschema of `schema` (itself first) with where it sits."""
    yield at, schema
    for keyword, value in schema.items():
        found: list[tuple[tuple[str, ...], Any]]
        if keyword in ONE_SUBSCHEMA:
            found = [((keyword,), value)]
        elif keyword in SUBSCHEMA_MAPS and isinstance(value, dict):
            found = [((keyword, name), sub) for name, sub in value.items()]
        elif keyword in SUBSCHEMA_LISTS and isinstance(value, list):
            found = [((keyword, str(i)), sub) for i, sub in enumerate(value)]
        else:
            continue
        for where, sub in found:
            if isinstance(sub, dict):
                yield from subschemas(sub, at + where)
            else:
                yield at + where, sub


def problems(schema: object) -> list[str]:
    """What makes `schema` unusable as a queue schema (empty: nothing)."""
    if not isinstance(schema, dict):
        return ["the schema must be a JSON object"]
    declared = schema.get("$schema", DRAFT_2020_12)
    if declared not in (DRAFT_2020_12, DRAFT_2020_12 + "#"):
        return [f"$schema must be {DRAFT_2020_12} (got {declared!r})"]
    found: list[str] = []
    for at, sub in subschemas(schema):
        where = pointer(at) or "/"
        if isinstance(sub, bool):
            continue
        if not isinstance(sub, dict):
            found.append(f"{where}: a subschema must be an object or a boolean")
            continue
        for keyword, value in sub.items():
            if keyword not in SUPPORTED:
                found.append(f"{where}: keyword {keyword!r} is not supported (see docs/schemas.md)")
            elif keyword == "items" and not isinstance(value, (dict, bool)):
                found.append(f"{where}: items must be one schema (prefixItems is not supported)")
            elif keyword == "$ref" and not (isinstance(value, str) and value.startswith("#")):
                found.append(f"{where}: $ref must point inside the schema (#/$defs/...)")
            elif keyword in ("$schema", "$id") and at:
                found.append(f"{where}: {keyword} is allowed only at the top of the schema")
    return found
