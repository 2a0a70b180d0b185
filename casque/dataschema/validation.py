"""Checking a message's data against its queue's schema, compiled once per schema version.

fastjsonschema turns a schema into Python code once; each check then costs a few µs
(bench/bench_schema.py: about 5 µs for an order of a few lines, where jsonschema took about
100). Compiled checks are kept by the schema's text, so every publisher of a queue, and
every queue with the same schema, shares one.

Only JSON data is checked, and on a queue with a schema only JSON data is accepted: data
that is not JSON (another content type, bytes that do not parse) is refused under the rule
`contentType`, since nothing else could be checked.

Data nested deeper than MAX_DATA_DEPTH is refused unchecked (DataTooDeep, rule `maxDepth`):
the json module and the compiled check each spend a stack frame or more per level, and past
about a thousand Python raises RecursionError. The depth is measured without recursion, and
only for data with more brackets than the limit, which a typical message never has. Patterns
are matched by RE2 (patterns.py); a schema in force may keep one RE2 refuses from before,
searched within a bound, and a search past it refuses the message (rule `pattern`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import fastjsonschema

from casque.dataschema.keywords import pointer, problems
from casque.errors import DataTooDeep, SchemaViolation

log = logging.getLogger(__name__)

JSON_MEDIA_TYPES = ("application/json", "text/json")
# Compiled checks kept at once; a sidecar serves a handful of queues, each with one version in force.
CACHED_SCHEMAS = 64
# How deep checked data may nest: `[]` and `{}` are one level, `[[]]` two. Far beyond what
# messages use, and far within the stack: a recursive schema costs a frame or two per level.
MAX_DATA_DEPTH = 128
DEPTH_RULE = "maxDepth"
_TOO_DEEP = f"nests deeper than {MAX_DATA_DEPTH} levels, the most a schema check takes"


def is_json(content_type: str | None) -> bool:
    """Whether a content type says JSON; none at all is JSON, as in the sidecar's API."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media in JSON_MEDIA_TYPES or media.endswith("+json")


def canonical(schema: dict[str, Any]) -> str:
    """The schema's text with keys sorted: two schemas are one version when these agree."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Failure:
    """Where and why data failed its schema."""

    path: str  # JSON pointer into the data; "" is the whole
    rule: str  # the keyword that failed
    problem: str  # what the rule wanted, for people

    def describe(self) -> str:
        return f"data at {self.path or '/'} breaks {self.rule!r}: {self.problem}"


def invalid_schema(schema: object, linear_only: bool = True) -> str | None:
    """Why `schema` cannot be a queue schema, as one line (None: it can). Not `linear_only`:
    as a schema in force from before is read (patterns.py), a pattern RE2 refuses allowed."""
    import fastjsonschema  # in the functions: a process whose queues have no schema never loads it

    found = problems(schema)
    if not found:
        try:
            _compiled(canonical(schema), linear_only)  # type: ignore[arg-type]  # problems() proved a dict
        except fastjsonschema.JsonSchemaDefinitionException as error:
            found = [str(error)]
        except re.error as error:  # RE2 took the pattern, Python's parser (fastjsonschema's) did not
            found = [f"pattern {error.pattern!r} is not one both RE2 and Python read: {error}"]
    if not found:
        return None
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return "; ".join(found[:3]) + more


@functools.lru_cache(maxsize=CACHED_SCHEMAS)
def _compiled(text: str, linear_only: bool = False) -> Callable[[Any], Any]:
    # Formats are not asserted (2020-12's default; keywords.py), and defaults never fill in
    # the data: a check must not change the message it checks. fastjsonschema.compile with
    # the generator of patterns.py: the same four steps.
    from fastjsonschema.ref_resolver import RefResolver

    from casque.dataschema.patterns import Re2CodeGenerator

    definition = json.loads(text)
    resolver = RefResolver.from_schema(definition, store={})
    generator = Re2CodeGenerator(  # type: ignore[no-untyped-call]
        definition, resolver=resolver, use_default=False, use_formats=False)
    generator.linear_only = linear_only
    namespace = generator.global_state
    exec(generator.func_code, namespace)  # noqa: S102 - fastjsonschema's own way to build the check
    check: Callable[[Any], Any] = namespace[resolver.get_scope_name()]
    return check


def failure_of(error: fastjsonschema.JsonSchemaValueException) -> Failure:
    """fastjsonschema's error as a path, a rule and a problem.

    It names the failing place as `data.lines[2].quantity`; the parts after `data` become a
    JSON pointer (a property whose name holds `.` or `[` reads ambiguously there, and so does
    it here). The problem is its message with that name cut off the front.
    """
    parts = tuple(error.path[1:]) if error.path else ()
    name = error.name or "data"
    problem = error.message.removeprefix(name).strip() or error.message
    return Failure(path=pointer(parts), rule=str(error.rule or "schema"), problem=problem)


@dataclass(frozen=True)
class CompiledSchema:
    """One version of a queue's schema, ready to check messages."""

    version: int
    check_value: Callable[[Any], Any]

    @classmethod
    def of(cls, schema: dict[str, Any], version: int) -> CompiledSchema:
        """The schema in force (its patterns as they were accepted: see patterns.py)."""
        check = cls(version=version, check_value=_compiled(canonical(schema)))
        if (problem := invalid_schema(schema)) is not None:
            log.warning("schema version %s stays in force though a new schema like it would be refused (%s): "
                        "each search of such a pattern is given up after a bound and refuses its message; "
                        "change the schema (docs/schemas.md)", version, problem)
        return check

    def failure(self, payload: bytes, content_type: str | None) -> Failure | None:
        """Why the data fails this schema (None: it matches)."""
        if not is_json(content_type):
            return Failure("", "contentType", f"the queue has a schema, so data must be JSON, not {content_type}")
        try:
            value = json.loads(payload)
        except RecursionError:
            return Failure("", DEPTH_RULE, _TOO_DEEP)
        except ValueError:
            return Failure("", "contentType", "the queue has a schema, so data must be JSON; this is not")
        # Brackets counted in C (strings' included) bound the depth from above: most data is
        # proved shallow without a walk.
        if payload.count(b"[") + payload.count(b"{") > MAX_DATA_DEPTH and not nests_within(value, MAX_DATA_DEPTH):
            return Failure("", DEPTH_RULE, _TOO_DEEP)
        import fastjsonschema  # loaded already, by `_compiled`

        from casque.dataschema.patterns import BOUNDED_SEARCH_SECONDS, PatternTimeout

        try:
            self.check_value(value)
        except fastjsonschema.JsonSchemaValueException as error:
            return failure_of(error)
        except RecursionError:  # a schema whose every level costs many frames
            return Failure("", DEPTH_RULE, _TOO_DEEP)
        except PatternTimeout as timeout:
            return Failure("", "pattern", f"pattern {timeout.pattern!r} took longer than "
                           f"{BOUNDED_SEARCH_SECONDS * 1000:.0f} ms to search this data (a pattern RE2 does not match, "
                           "kept from before; see docs/schemas.md)")
        return None

    def check(self, payload: bytes, content_type: str | None) -> None:
        """Raise SchemaViolation unless the data matches."""
        failure = self.failure(payload, content_type)
        if failure is not None:
            refusal = DataTooDeep if failure.rule == DEPTH_RULE else SchemaViolation
            raise refusal(
                f"{failure.describe()} (schema version {self.version})",
                path=failure.path, rule=failure.rule, version=self.version,
            )


def nests_within(value: Any, levels: int) -> bool:
    """Whether JSON `value` nests at most `levels` deep (a scalar is 0, `[]` 1), measured a
    level at a time, without recursion."""
    level = [value]
    for _ in range(levels):
        level = [c for item in level if type(item) in (list, dict)
                 for c in (item.values() if type(item) is dict else item)]
        if not level:
            return True
    return not any(type(item) in (list, dict) for item in level)
