"""Whether a new version of a queue's schema is backward compatible with the one in force.

Backward compatible means: the new schema accepts every message the old one accepted, so
nothing a producer may still send is refused after the change, and a consumer written for
the new schema can read everything already stored. Deciding that for any two schemas is
undecidable in general, so casque decides it by rules that are sound (a change they call
compatible is compatible) and conservative (some compatible changes are called
incompatible; `spec.schemaCompatibility: none` lets them through).

The two schemas are compared place by place. A schema is the conjunction of its keywords,
so the new one accepts all the old one did when each new keyword is implied by the old
keywords at the same place:

- annotations (`title`, `description`, `format`, ...) never matter;
- a subschema that is the same, or a new one that constrains nothing (`true`, `{}`), or an
  old one that accepted nothing (`false`), is compatible;
- `type`: the new types include the old ones (`number` includes `integer`);
- `enum`: the new values include the old ones (or the old `const`); `const`: unchanged;
- lower bounds (`minimum`, `exclusiveMinimum`, `minLength`, `minItems`, `minProperties`)
  stay or go down, upper bounds stay or go up; `multipleOf`: the old one is a multiple of
  the new one;
- `required`: the new list is part of the old one (removing a name is compatible);
- `properties`: a property of both is compared recursively; a property the old schema did
  not list is compatible if its new schema accepts what the old `additionalProperties` did
  (so adding an optional property is compatible where the old schema closed the object
  with `additionalProperties: false`, which accepted no such property at all, and not where
  it left the object open: there the old schema accepted the property with any value); a
  property the new schema drops falls to the new `additionalProperties`, which must accept
  what the old property's schema did;
- `additionalProperties`, `items`, `propertyNames`: compared recursively (absent is `true`);
- `anyOf`: alternatives may be added, none removed or changed; `allOf`: entries may be
  removed, none added or changed;
- `pattern`, `uniqueItems`, `contains`, `not`, `oneOf`, `if`/`then`/`else`, `$ref`,
  `patternProperties` and `$defs`: unchanged, or removed (`uniqueItems` may turn false);
  with `patternProperties`, the listed properties must stay the same.

Anything else is incompatible, with a reason naming the place (a JSON pointer into the
schema) and the keyword.
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

from casque.dataschema.keywords import ANNOTATIONS, pointer

LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
# Compatible only if unchanged or removed.
UNCHANGED_OR_REMOVED = ("pattern", "contains", "not", "oneOf", "if", "then", "else", "$ref", "patternProperties",
                        "$defs")
# Compared jointly by _objects.
OBJECT_KEYWORDS = ("properties", "additionalProperties", "patternProperties")


def incompatibilities(old: object, new: object) -> list[str]:
    """Why `new` may refuse a message `old` accepted (empty: it accepts all of them)."""
    return _compare(old, new, ())


def _json(value: object) -> str:
    """A value as JSON text with sorted keys. Python calls `True == 1` and `{"const": True} ==
    {"const": 1}`; JSON Schema does not, so values are compared by their JSON text (which also
    tells 1 from 1.0 apart: a conservative answer, never an unsound one)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _same(a: object, b: object) -> bool:
    return _json(a) == _json(b)


def _within(values: list[Any], others: list[Any]) -> list[Any]:
    """The values that are not among `others`, compared as JSON."""
    known = {_json(v) for v in others}
    return [v for v in values if _json(v) not in known]


def _constraints(schema: object) -> object:
    """The schema without its annotations (a boolean schema stays as it is)."""
    if isinstance(schema, dict):
        return {k: v for k, v in schema.items() if k not in ANNOTATIONS}
    return schema


def _accepts_all(schema: object) -> bool:
    return schema is True or schema == {}


def _compare(old: object, new: object, at: tuple[str, ...]) -> list[str]:
    old, new = _constraints(old), _constraints(new)
    if _same(old, new) or _accepts_all(new) or old is False:
        return []
    where = pointer(at) or "/"
    if new is False:
        return [f"{where}: the new schema accepts nothing here"]
    if old is True or old == {}:
        old = {}
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [f"{where}: not a schema"]
    found: list[str] = []
    for keyword in sorted(set(new) | set(old)):
        if keyword in OBJECT_KEYWORDS:
            continue
        before, after = old.get(keyword), new.get(keyword)
        if after is None or _same(before, after):
            continue  # unchanged, or a constraint removed
        found.extend(_keyword(keyword, before, after, old, at))
    found.extend(_objects(old, new, at))
    return found


def _keyword(keyword: str, before: Any, after: Any, old: dict[str, Any], at: tuple[str, ...]) -> list[str]:
    where = pointer(at) or "/"
    if keyword == "type":
        if before is None:
            return [f"{where}: type {after!r} added"]
        wanted = {before} if isinstance(before, str) else set(before)
        allowed = {after} if isinstance(after, str) else set(after)
        if "number" in allowed:
            allowed.add("integer")
        lost = sorted(wanted - allowed)
        return [f"{where}: type no longer allows {', '.join(lost)}"] if lost else []
    if keyword == "enum":
        had = before if before is not None else ([old["const"]] if "const" in old else None)
        if had is None:
            return [f"{where}: enum added"]
        lost = _within(had, after)
        return [f"{where}: enum no longer allows {lost!r}"] if lost else []
    if keyword == "const":
        return [f"{where}: const {'added' if before is None else 'changed'}"]
    if keyword == "required":
        added = sorted(set(after) - set(before or ()))
        return [f"{where}: required adds {', '.join(added)}"] if added else []
    if keyword in LOWER_BOUNDS or keyword in UPPER_BOUNDS:
        if before is None:
            return [f"{where}: {keyword} {after} added"]
        lower = keyword in LOWER_BOUNDS
        tighter = after > before if lower else after < before
        return [f"{where}: {keyword} {'raised' if lower else 'lowered'} from {before} to {after}"] if tighter else []
    if keyword == "multipleOf":
        if before is None:
            return [f"{where}: multipleOf {after} added"]
        if (Fraction(str(before)) / Fraction(str(after))).denominator != 1:
            return [f"{where}: multipleOf {after} does not divide the old {before}"]
        return []
    if keyword == "uniqueItems":
        return [f"{where}: uniqueItems turned on"] if after is True and before is not True else []
    if keyword in ("items", "propertyNames"):
        return _compare(True if before is None else before, after, at + (keyword,))
    if keyword == "anyOf":
        if before is None:
            return [f"{where}: anyOf added"]
        lost = [i for i, alternative in enumerate(before) if _within([alternative], after)]
        return [f"{where}: anyOf no longer holds alternative {i}" for i in lost]
    if keyword == "allOf":
        if before is None:
            return [f"{where}: allOf added"]
        added = [i for i, entry in enumerate(after) if _within([entry], before)]
        return [f"{where}: allOf adds entry {i}" for i in added]
    if keyword in UNCHANGED_OR_REMOVED:
        return [f"{where}: {keyword} {'added' if before is None else 'changed'}"]
    return [f"{where}: {keyword} changed, which casque cannot prove compatible"]


def _objects(old: dict[str, Any], new: dict[str, Any], at: tuple[str, ...]) -> list[str]:
    """`properties`, `additionalProperties` and `patternProperties`, which act together."""
    old_props: dict[str, Any] = old.get("properties", {})
    new_props: dict[str, Any] = new.get("properties", {})
    old_extra = old.get("additionalProperties", True)
    new_extra = new.get("additionalProperties", True)
    patterns = old.get("patternProperties", {}) or new.get("patternProperties", {})
    found: list[str] = []
    if patterns and set(old_props) != set(new_props):
        found.append(f"{pointer(at) or '/'}: properties changed beside patternProperties")
        return found
    for name in sorted(set(old_props) | set(new_props)):
        before = old_props.get(name, old_extra)
        after = new_props.get(name, new_extra)
        found.extend(_compare(before, after, at + ("properties", name)))
    found.extend(_compare(old_extra, new_extra, at + ("additionalProperties",)))
    return found
