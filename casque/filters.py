"""Subscriber filters: a CEL expression over a message's attributes, key, priority and its
CloudEvents source, type and subject, checked when it is compiled.

CEL (the expression language of Kubernetes' CRD validation rules) is compiled by
cel-expr-python, the Python binding of the CEL project's own C++ implementation: it checks
types when an expression is compiled, so a misspelt variable, a comparison of a number with
a string or an expression that is not true or false is refused by the operator, with the
checker's message, before any message meets it. An expression is compiled once per
subscriber spec and evaluated per message (bench/bench_filter.py).

A message matches when the expression evaluates to true. Anything else does not match:
false, and an evaluation error, which in CEL is mostly a missing map key (reading
`attributes.region` of a message without that attribute), as in Pub/Sub, where a filter on
an absent attribute does not match. `has(attributes.region)` says it explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# Longer expressions are refused (the CRD says the same): a filter is a predicate, not a program.
MAX_FILTER_LENGTH = 4096

# The variables an expression may read, by name, and their CEL types; `type` is a CEL
# built-in, hence `eventType`.
VARIABLES: Mapping[str, str] = {
    "attributes": "map(string, string)",
    "key": "string",
    "priority": "int",
    "source": "string",
    "eventType": "string",
    "subject": "string",
}


@lru_cache(maxsize=1)
def _cel() -> tuple[Any, Any]:
    """The CEL module and the environment of VARIABLES, made at the first compile: the C++
    library costs a sidecar about 6 MiB of RSS, and most subscribers have no filter."""
    from cel_expr_python import cel

    string = cel.Type.STRING
    types = {"string": string, "int": cel.Type.INT, "map(string, string)": cel.Type.Map(string, string)}
    return cel, cel.NewEnv(variables={name: types[kind] for name, kind in VARIABLES.items()})


class InvalidFilter(ValueError):
    """The expression does not compile, or is not a condition (true or false)."""


@dataclass(frozen=True)
class MessageFilter:
    expression: str
    _program: Any

    def matches(self, variables: Mapping[str, object]) -> bool:
        """Whether a message with these variables (every one of VARIABLES) matches."""
        value = self._program.eval(data=variables).value()
        return value is True


@lru_cache(maxsize=256)
def compile_filter(expression: str) -> MessageFilter:
    """The compiled filter, kept for the next call with the same expression (a consumer asks
    for its subscriber's at every message); InvalidFilter with the checker's message if it
    cannot be one."""
    return build_filter(expression)


def build_filter(expression: str) -> MessageFilter:
    """The compiled filter, compiled anew (compile_filter keeps them)."""
    if not expression.strip():
        raise InvalidFilter("a filter must not be empty")
    if len(expression) > MAX_FILTER_LENGTH:
        raise InvalidFilter(f"a filter is at most {MAX_FILTER_LENGTH} characters")
    cel, environment = _cel()
    try:
        program = environment.compile(expression)
    except RuntimeError as error:
        raise InvalidFilter(_checker_message(str(error))) from None
    returns = program.return_type()
    if returns != cel.Type.BOOL and returns != cel.Type.DYN:
        raise InvalidFilter(f"a filter must be a condition (true or false), not a value of type {returns.name().lower()}")
    return MessageFilter(expression, program)


def _checker_message(text: str) -> str:
    """The checker's first error in one line, without its status code and the source excerpt
    under it: `INVALID_ARGUMENT: ERROR: <input>:1:1: undeclared reference to 'x' (in container
    '')` and two more lines -> `1:1: undeclared reference to 'x'`."""
    first = text.strip().splitlines()[0] if text.strip() else "the expression does not compile"
    for prefix in ("INVALID_ARGUMENT:", "ERROR:", "<input>:"):
        first = first.strip().removeprefix(prefix)
    return first.replace(" (in container '')", "").removesuffix("[INVALID_ARGUMENT]").strip()
